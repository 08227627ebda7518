"""`make demo`: the disaggregated service on the embedded default, end to end.

Starts `pdserve serve` (local Ray, tiny model, 1 prefill + 1 decode worker, gloo transport),
sends a few requests through gRPC (two share a long prefix), prints each one's text and TTFT
breakdown, then stops the server with SIGTERM (it drains and exits 0).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from pdserve.client import Client

SHARED = (
    "You are a helpful assistant for a serving system. The prefill worker reads the "
    "whole prompt at once and writes its KV cache; the decode worker then "
)
PROMPTS = (
    SHARED + "streams tokens back.",
    SHARED + "batches many requests.",
    "Hello, world",
)
READY = re.compile(r"pdserve: gRPC listening on (\S+)")


def start_server() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--grpc-port", "0"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        m = READY.search(line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("pdserve demo: the server did not come up")


def main() -> int:
    t0 = time.perf_counter()
    print(
        "pdserve demo: starting `pdserve serve` (local Ray, tiny model, 1 prefill + "
        "1 decode worker, torch_dist/gloo transport) ...",
        flush=True,
    )
    proc, target = start_server()
    print(f"pdserve demo: server ready on {target} after {time.perf_counter() - t0:.1f} s\n")
    client = Client(target, timeout_s=60)
    try:
        for i, prompt in enumerate(PROMPTS):
            out = client.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
            c = out.complete
            assert c is not None
            t = c.timings
            print(f"[{i}] {prompt[:60]!r}{'...' if len(prompt) > 60 else ''}")
            print(f"    -> {out.text!r}")
            print(
                f"    {c.usage.prompt_tokens} prompt tokens ({c.usage.cached_tokens} from the "
                f"prefix cache), {c.usage.completion_tokens} generated, finish="
                f"{out.finish_reason}; prefill on {c.prefill_worker or '-'}, decode on "
                f"{c.decode_worker}"
            )
            print(
                f"    TTFT {t.ttft_ms:.1f} ms = queue {t.queue_ms:.1f} + prefill "
                f"{t.prefill_ms:.1f} + transfer {t.transfer_ms:.1f} + relay; decode "
                f"{t.decode_ms:.1f} ms ({t.decode_ms / max(c.usage.completion_tokens - 1, 1):.1f}"
                " ms/token)\n"
            )
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    print(f"pdserve demo: server drained and exited with code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
