"""`pdserve trace`: the JSON report's structure, and its counts against independent formulas.

The FLOP and KV-byte expectations are written out from the tiny preset's sizes here, not
taken from `pdserve.trace`, so a counting bug there cannot cancel out. The measurement sizes
are shrunk (small matmul, small copy, few repeats) so the test runs in seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve import trace
from pdserve.checkpoint import PRESETS, write_checkpoint
from pdserve.cli import main

PROMPT = "the prefill worker reads the prompt"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


QUICK = {
    "PEAK_MATMUL_N": 128,
    "PEAK_MATMUL_MAX_N": 256,
    "PEAK_REPEATS": 2,
    "BANDWIDTH_BYTES": 1 << 20,
    "BANDWIDTH_REPEATS": 2,
    "ENGINE_RUNS": 2,
    "OP_MIN_REPEATS": 1,
    "OP_MAX_REPEATS": 3,
    "OP_BUDGET_S": 0.0,
}


@pytest.fixture(autouse=True, scope="module")
def quick_measurements() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    for name, value in QUICK.items():
        mp.setattr(trace, name, value)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def report(tiny_dir: Path) -> dict:
    return _run_json(tiny_dir, PROMPT)


def _run_json(model_dir: Path, prompt: str) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["trace", "--json", "--model", str(model_dir), prompt])
    assert rc == 0
    lines = buf.getvalue().strip().splitlines()
    assert len(lines) == 1, "--json prints exactly one JSON object"
    return json.loads(lines[0])


def _tiny_sizes() -> dict[str, int]:
    p = PRESETS["tiny"]
    head_dim = p.hidden_size // p.num_heads
    return {
        "d": p.hidden_size,
        "ffn": p.intermediate_size,
        "layers": p.num_layers,
        "heads": p.num_heads,
        "kv_heads": p.num_kv_heads,
        "head_dim": head_dim,
        "vocab": p.vocab_size,
    }


def test_structure(report: dict) -> None:
    s = _tiny_sizes()
    assert report["model"]["num_layers"] == s["layers"]
    assert report["model"]["dtype"] == "float32" and report["model"]["dtype_bytes"] == 4
    m = report["machine"]
    assert m["matmul_peak_flop_per_s"] > 0 and m["memory_bandwidth_byte_per_s"] > 0
    assert m["memory_bandwidth_byte_per_s"] == max(
        m["copy_bandwidth_byte_per_s"], m["read_bandwidth_byte_per_s"]
    )
    assert m["matmul_n"] in (128, 256)
    assert m["ridge_flop_per_byte"] == pytest.approx(
        m["matmul_peak_flop_per_s"] / m["memory_bandwidth_byte_per_s"]
    )
    t = report["prompt"]["num_tokens"]
    assert t == len(report["prompt"]["token_ids"]) > 1
    for name, n_tokens, ctx in (("prefill", t, t), ("decode", 1, t + 1)):
        p = report[name]
        assert (p["num_tokens"], p["context_len"]) == (n_tokens, ctx)
        for key in (
            "flops",
            "bytes_read",
            "bytes_written",
            "weight_bytes",
            "kv_bytes_written",
            "time_ms",
            "step_time_ms",
            "intensity_flop_per_byte",
            "achieved_flop_per_s",
            "attainable_flop_per_s",
            "fraction_of_peak",
            "fraction_of_attainable",
        ):
            assert isinstance(p[key], int | float), (name, key)
        assert p["time_ms"] > 0 and p["step_time_ms"] >= p["time_ms"]
        assert p["bound"] in ("compute-bound", "memory-bound")
        assert p["verdict"].startswith(f"{name}: ")
        assert p["intensity_flop_per_byte"] == pytest.approx(
            p["flops"] / (p["bytes_read"] + p["bytes_written"])
        )
        assert p["attainable_flop_per_s"] == pytest.approx(
            min(
                m["matmul_peak_flop_per_s"],
                p["intensity_flop_per_byte"] * m["memory_bandwidth_byte_per_s"],
            )
        )
        assert p["flops"] == p["matmul_flops"] + p["attention_flops"] + p["elementwise_flops"]
        # Per-layer rows, embed and head add up to the phase (counts and measured time).
        parts = [p["embed"], *p["layers"], p["head"]]
        for key in ("flops", "bytes_read", "bytes_written", "kv_bytes_written"):
            assert sum(x[key] for x in parts) == p[key], (name, key)
        assert [x["layer"] for x in p["layers"]] == list(range(s["layers"]))
        timed = sum(x["time_ms"] for x in p["layers"]) + p["head"]["time_ms"]
        assert timed == pytest.approx(p["time_ms"], rel=0.01, abs=0.01)
        names = [op["name"] for op in p["layer_ops"]]
        assert names[0] == "embed" and names[-2:] == ["final_norm", "lm_head"]
        assert ("kv_append" in names) == (name == "decode")
        assert all(op["time_ms"] is not None and op["time_ms"] >= 0 for op in p["layer_ops"])


def test_shapes(report: dict) -> None:
    s = _tiny_sizes()
    t = report["prompt"]["num_tokens"]
    ops = {op["name"]: op for op in report["prefill"]["layer_ops"]}
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    assert ops["qkv_proj"]["outputs"] == {"qkv": [t, q + 2 * kv]}
    assert ops["attention"]["inputs"]["q"] == [s["heads"], t, s["head_dim"]]
    assert f"scores [{s['heads']},{t},{t}]" in ops["attention"]["note"]
    assert ops["gate_up_proj"]["outputs"] == {"gate_up": [t, 2 * s["ffn"]]}
    assert ops["lm_head"]["outputs"] == {"logits": [1, s["vocab"]]}


def _expected_flops(t: int, ctx: int, prefill: bool) -> tuple[int, int]:
    """(matmul, attention) FLOPs of a step of `t` new tokens at context `ctx`, head on 1 row.

    A prefill step's last layer computes qkv for all `t` tokens (their K/V is kept) and the
    rest (attention, o_proj, MLP) for the one row that gives logits, the last one."""
    s = _tiny_sizes()
    d, f = s["d"], s["ffn"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    qkv_params, rest_params = d * (q + 2 * kv), q * d + 3 * d * f
    full = s["layers"] - (1 if prefill else 0)
    matmul = full * 2 * t * (qkv_params + rest_params) + 2 * s["vocab"] * d
    pairs = sum(p + 1 for p in range(ctx - t, ctx))  # causal: query p sees keys 0..p
    attention = full * 4 * s["heads"] * s["head_dim"] * pairs
    if prefill:  # the last layer
        matmul += 2 * t * qkv_params + 2 * 1 * rest_params
        attention += 4 * s["heads"] * s["head_dim"] * ctx  # the last query sees all ctx keys
    return matmul, attention


def test_flops_match_the_formula(report: dict) -> None:
    t = report["prompt"]["num_tokens"]
    for name, n_tokens, ctx in (("prefill", t, t), ("decode", 1, t + 1)):
        matmul, attention = _expected_flops(n_tokens, ctx, prefill=name == "prefill")
        p = report[name]
        assert p["matmul_flops"] == matmul, name
        assert p["attention_flops"] == attention, name
        # Elementwise work (norms, rotary, SiLU, residuals) is small next to the matmuls.
        assert 0 < p["elementwise_flops"] < 0.1 * p["flops"]
    # The prefill attention term is the causal triangle, T(T+1)/2 pairs per head, in every
    # layer but the last, where only the last query (T pairs) goes on.
    s = _tiny_sizes()
    per_pair = 4 * s["heads"] * s["head_dim"]
    tri = (s["layers"] - 1) * per_pair * t * (t + 1) // 2 + per_pair * t
    assert report["prefill"]["attention_flops"] == tri


def test_kv_bytes(report: dict) -> None:
    s = _tiny_sizes()
    t = report["prompt"]["num_tokens"]
    per_token = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 4  # K and V, float32
    assert report["prefill"]["kv_bytes_written"] == t * per_token
    assert report["decode"]["kv_bytes_written"] == per_token
    for layer in report["prefill"]["layers"]:
        assert layer["kv_bytes_written"] == t * per_token // s["layers"]
    assert report["prefill"]["kv_bytes_read"] == 0  # no cached prefix
    assert report["decode"]["kv_bytes_read"] == (t + 1) * per_token  # attention reads the context


def test_weights_read_once_per_step(report: dict) -> None:
    s = _tiny_sizes()
    d, f, v = s["d"], s["ffn"], s["vocab"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
    t = report["prompt"]["num_tokens"]
    for name, n_tokens in (("prefill", t), ("decode", 1)):
        expected = (s["layers"] * per_layer + d + v * d + n_tokens * d) * 4
        assert report[name]["weight_bytes"] == expected, name


def test_attended_pairs_with_window() -> None:
    assert trace.attended_pairs(4, 4, None) == 10
    assert trace.attended_pairs(4, 4, 2) == 1 + 2 + 2 + 2
    assert trace.attended_pairs(1, 9, None) == 9
    assert trace.attended_pairs(1, 9, 4) == 4


def test_human_output(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", str(tiny_dir), "hello world"]) == 0
    out = capsys.readouterr().out
    for needle in ("prefill: one layer op by op", "decode: per layer", "qkv_proj", "roofline"):
        assert needle in out
    verdicts = [line for line in out.splitlines() if "bound (intensity" in line]
    assert [v.split(":")[0] for v in verdicts] == ["prefill", "decode"]


def test_prompt_over_the_chunk_budget_is_an_error(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "--model", str(tiny_dir), "word " * 3000]) == 2
    assert "chunk budget" in capsys.readouterr().err
