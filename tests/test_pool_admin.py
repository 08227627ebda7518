"""The pool admin on a real deployment: `pdserve serve` on a local Ray cluster (tiny model,
one prefill and one decode worker, an API key), changed under load with `pdserve pool`.

A decode worker is added, flipped to prefill (in its own process: the same pid, no reload),
and the original prefill worker is drained and stopped, while greedy streams run through
the gRPC API: every stream ends whole, with the answer it gets on the untouched deployment.
The routes refuse a missing or wrong key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.client import Client
from tests.serve_proc import ROOT, ServeProcess

KEY = "pool-admin-test-key"
PROMPTS = [[4 + (i * 31 + j * 7) % 400 for j in range(40 + i)] for i in range(6)]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tmp_path_factory.mktemp("pool"), env={"PDSERVE_API_KEY": KEY})
    yield proc
    proc.stop()


def pool(server: ServeProcess, *args: str, key: str | None = KEY) -> tuple[int, str, str]:
    """`pdserve pool ARGS --url ... --json` (exit code, stdout, stderr); the key in env."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    if key is not None:
        env["PDSERVE_API_KEY"] = key
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "pool", "--url", server.base_url, "--json", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode, out.stdout, out.stderr


def workers(server: ServeProcess) -> dict[str, dict[str, object]]:
    rc, out, err = pool(server, "status")
    assert rc == 0, err
    return {w["name"]: w for w in json.loads(out)["workers"]}


class Load:
    """Greedy streams, one after another on each of `n` threads, until stopped."""

    def __init__(self, server: ServeProcess, want: dict[int, list[int]], n: int = 3) -> None:
        self.server, self.want = server, want
        self.results: list[tuple[int, object]] = []  # (prompt, token ids or the error)
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        client = Client(self.server.grpc_target, timeout_s=120, api_key=KEY)
        i = k
        while not self._stop.is_set():
            p = i % len(PROMPTS)
            try:
                done = client.generate(PROMPTS[p], max_tokens=MAX_TOKENS, temperature=0.0,
                                       ignore_eos=True)  # fmt: skip
                self.results.append((p, done.token_ids))
            except Exception as e:  # recorded: the test asserts there is none
                self.results.append((p, e))
            i += 3
        client.close()

    def stop(self) -> list[tuple[int, object]]:
        self._stop.set()
        for t in self.threads:
            t.join(180)
        return self.results


def test_workers_are_added_flipped_and_drained_under_load(server: ServeProcess) -> None:
    client = Client(server.grpc_target, timeout_s=120, api_key=KEY)
    want = {
        i: client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).token_ids
        for i, p in enumerate(PROMPTS)
    }
    client.close()
    before = workers(server)
    assert {n: w["role"] for n, w in before.items()} == {
        "pdserve-prefill-0": "prefill",
        "pdserve-decode-0": "decode",
    }

    load = Load(server, want)
    try:
        rc, out, err = pool(server, "add", "decode")
        assert rc == 0, err
        assert json.loads(out)["worker"] == "pdserve-decode-1"
        pid = workers(server)["pdserve-decode-1"]["pid"]

        rc, out, err = pool(server, "flip", "pdserve-decode-1", "--to", "prefill")
        assert rc == 0, err
        flipped = json.loads(out)
        assert flipped["role"] == "prefill" and flipped["ended"] == 0, flipped

        rc, out, err = pool(server, "drain", "pdserve-prefill-0")
        assert rc == 0, err
        assert json.loads(out)["ended"] == 0 and json.loads(out)["stopped"]
    finally:
        results = load.stop()

    after = workers(server)
    assert {n: (w["role"], w["state"]) for n, w in after.items()} == {
        "pdserve-decode-0": ("decode", "serving"),
        "pdserve-decode-1": ("prefill", "serving"),
    }
    assert after["pdserve-decode-1"]["pid"] == pid  # the same process: no reload
    errors = [r for _, r in results if not isinstance(r, list)]
    assert not errors, errors
    assert len(results) >= 6
    assert all(toks == want[p] for p, toks in results)
    log = Path(server.log_path).read_text()
    assert "pdserve-decode-1: decode -> prefill in" in log


def test_the_routes_refuse_a_missing_or_wrong_key(server: ServeProcess) -> None:
    for key in (None, "wrong"):
        rc, _, err = pool(server, "status", key=key)
        assert rc == 1 and "HTTP 401" in err, err
        rc, _, err = pool(server, "add", "decode", key=key)
        assert rc == 1 and "HTTP 401" in err, err
    status, _, _ = server.request(
        "POST", "/v1/admin/pool/drain", {"worker": "pdserve-decode-0"},
        headers={"Authorization": "Bearer wrong"},
    )  # fmt: skip
    assert status == 401
    assert set(workers(server)) >= {"pdserve-decode-0"}  # nothing changed
