#!/usr/bin/env python
"""The API side by side with vLLM's CPU build: the same requests to both servers (the default
model, float32, greedy), their answers compared field by field and token for token.

Run: ``.venv/bin/python benchmarks/peers_api.py`` (``make bench-peers-api``). It installs
vLLM's CPU build once into build/vllm-venv (benchmarks/peers.py's `ensure_vllm`), starts
vLLM, sends every request of `CASES`, stops it, then does the same with `pdserve serve`
(disaggregated), one server at a time. Each case reports:

- `status`: both HTTP statuses;
- `shape`: whether the response's keys (the choice's, its logprobs', its prompt_logprobs'
  entries') are the same set on both;
- `tokens`: whether each choice's generated token ids are equal (`return_tokens_as_token_ids`
  with `logprobs: 0`, so both name their tokens by id).

Results: ``benchmarks/results/peers_api-latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

from peers import BUILD, ensure_vllm, pdserve_server, vllm_server  # noqa: E402

from pdserve.models import DEFAULT_MODEL, resolve_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "peers_api-latest.json"
TEXT = "The city of Paris is the capital of France. It lies on the river"
BASE = {"temperature": 0, "max_tokens": 12, "logprobs": 0, "return_tokens_as_token_ids": True}
SAMPLED = {"temperature": 0.8, "seed": 3}
CASES: dict[str, dict[str, Any]] = {
    "one prompt": {"prompt": TEXT},
    "a list of prompts": {"prompt": [TEXT, "Name three primary colors:", "1, 2, 3,"]},
    "a list of token-id prompts": {"prompt": [[504, 3575, 282], [1780, 314, 253]]},
    "allowed_token_ids": {"prompt": TEXT, "allowed_token_ids": [28, 30, 253, 314, 2940, 3575]},
    "bad_words": {"prompt": TEXT, "bad_words": ["Seine", " the"]},
    "min_tokens with a stop string": {"prompt": TEXT, "min_tokens": 6, "stop": ["."]},
    "echo with logprobs": {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 1},
    "prompt_logprobs": {"prompt": TEXT, "prompt_logprobs": 2, "max_tokens": 2},
    # vLLM refuses n > 1 when greedy ("n must be 1 when using greedy sampling"): these
    # sample (seeded), so their tokens differ between the two (each its own RNG); the
    # shapes and the number of choices are what compare
    "n=3 (sampled)": {"prompt": TEXT, "n": 3, **SAMPLED},
    "a list of prompts with n=2 (sampled)": {"prompt": [TEXT, "1, 2, 3,"], "n": 2, **SAMPLED},
    "n=2 with echo and prompt_logprobs (sampled)": {
        "prompt": TEXT,
        "n": 2,
        "echo": True,
        "prompt_logprobs": 1,
        "max_tokens": 2,
        **SAMPLED,
    },
    "n=3 greedy": {"prompt": TEXT, "n": 3},
    "best_of=2": {"prompt": TEXT, "best_of": 2},
}


def post(base_url: str, model: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"model": model, **BASE, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def run(server: Any, model: str) -> dict[str, tuple[int, dict[str, Any]]]:
    with server:
        return {name: post(server.base_url, model, body) for name, body in CASES.items()}


def _ids(choice: dict[str, Any]) -> list[str]:
    return list((choice.get("logprobs") or {}).get("tokens") or [])


def _shape(resp: dict[str, Any]) -> list[str]:
    """The key paths of a response that matter for the comparison."""
    keys = []
    for c in resp.get("choices", []):
        keys += [f"choice.{k}" for k in c]
        keys += [f"logprobs.{k}" for k in c.get("logprobs") or {}]
        for entry in (c.get("prompt_logprobs") or [])[1:2]:
            for v in entry.values():
                keys += [f"prompt_logprobs.{k}" for k in v]
    return sorted(set(keys))


def compare(vllm: dict[str, Any], pdserve: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name in CASES:
        (vs, v), (ps, p) = vllm[name], pdserve[name]
        vc, pc = v.get("choices", []), p.get("choices", [])
        out[name] = {
            "status": [vs, ps],
            "shape_equal": _shape(v) == _shape(p),
            "shape_only_vllm": sorted(set(_shape(v)) - set(_shape(p))),
            "shape_only_pdserve": sorted(set(_shape(p)) - set(_shape(v))),
            "choices": [len(vc), len(pc)],
            "tokens_equal": [_ids(a) == _ids(b) for a, b in zip(vc, pc, strict=False)],
            "texts": [[c.get("text") for c in vc], [c.get("text") for c in pc]],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--vllm-start-timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    model = resolve_model(DEFAULT_MODEL)
    run_dir = BUILD / "peers-api"
    run_dir.mkdir(parents=True, exist_ok=True)
    cli = ensure_vllm()
    t0 = time.perf_counter()
    vllm = run(vllm_server(cli, model, DEFAULT_MODEL, run_dir, args, "float32"), DEFAULT_MODEL)
    ours = run(
        pdserve_server("pdserve", model, DEFAULT_MODEL, run_dir, args, "float32"), DEFAULT_MODEL
    )
    cases = compare(vllm, ours)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": DEFAULT_MODEL,
        "wall_s": round(time.perf_counter() - t0, 1),
        "cases": cases,
        "raw": {"vllm": vllm, "pdserve": ours},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    for name, c in cases.items():
        print(
            f"{name:32s} status {c['status']}  shape {'=' if c['shape_equal'] else '!='}  "
            f"choices {c['choices']}  tokens equal {c['tokens_equal']}"
        )
        if not c["shape_equal"]:
            print(
                f"{'':32s} only vLLM: {c['shape_only_vllm']}  "
                f"only pdserve: {c['shape_only_pdserve']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
