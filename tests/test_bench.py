"""`pdserve bench` against a real `pdserve serve` and a fake OpenAI server.

The server is the tiny preset under a temporary PDSERVE_HOME, a subprocess shared with the
other modules that need only a stock server (tests/serve_proc.py `shared_server`). The
bench runs in process through `pdserve.cli.main(["bench", ...])`, so the
subcommand registration, the printed vLLM-style block and the result JSON are all checked.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import main
from pdserve.tools.bench import (
    RequestOutput,
    arrival_offsets,
    calculate_metrics,
    default_result_filename,
    format_result,
    parse_goodput,
)
from tests.serve_proc import ServeProcess, shared_server

pytestmark = pytest.mark.timeout(300)

BLOCK_LABELS = [
    "Successful requests:",
    "Failed requests:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Request throughput (req/s):",
    "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):",
    "Mean TTFT (ms):",
    "Median TTFT (ms):",
    "P99 TTFT (ms):",
    "Mean TPOT (ms):",
    "Median TPOT (ms):",
    "P99 TPOT (ms):",
    "Mean ITL (ms):",
    "Median ITL (ms):",
    "P99 ITL (ms):",
]
JSON_KEYS = [
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    *(
        f"{s}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for s in ("mean", "median", "std", "p99")
    ),
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "errors",
    "failures_by_status",
    "mean_queue_ms",
    "mean_prefill_ms",
    "mean_transfer_ms",
    "cached_tokens",
]


# ---- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    """The `pdserve serve --model tiny` this module shares with the other stock-server
    modules (tests/conftest.py `SHARED_SERVERS`): what is checked here depends on no state
    a request before it leaves (fresh random or seeded prompts, nothing counted server-side)."""
    return shared_server("tiny-server", tmp_path_factory)


@pytest.fixture(scope="module")
def home(shared: ServeProcess) -> Path:
    return shared.home


@pytest.fixture(scope="module")
def server(shared: ServeProcess) -> dict[str, str]:
    return {"grpc": shared.grpc_target, "http": shared.base_url.removeprefix("http://")}


@pytest.fixture(scope="module")
def target(server: dict[str, str]) -> str:
    return server["grpc"]


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["bench", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def parse_block(stdout: str) -> dict[str, str]:
    """The "Serving Benchmark Result" block as {label: value}; checks its frame."""
    lines = stdout.splitlines()
    start = lines.index("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    end = lines.index("=" * 50, start + 1)
    rows: dict[str, str] = {}
    for line in lines[start + 1 : end]:
        if line.startswith("-"):  # section headers: 50 wide, centred in dashes
            assert len(line) == 50, line
            continue
        m = re.fullmatch(r"(.+?:)\s+(\S+)\s*", line)
        assert m, f"not a label/value row: {line!r}"
        assert len(line) >= 41 and line[40] == " ", f"label column is not 40 wide: {line!r}"
        rows[m.group(1)] = m.group(2)
    return rows


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


# ---- against pdserve serve -----------------------------------------------------------------
def test_random_dataset_at_rate(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "random.json"
    rc, out, err = bench(
        capsys,
        "--target",
        target,
        "--dataset-name",
        "random",
        "--num-prompts",
        "50",
        "--request-rate",
        "4",
        "--goodput",
        "ttft:2000",
        "tpot:200",
        "--save-result",
        "--result-filename",
        str(result),
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
    )
    assert rc == 0, err
    assert "Traffic request rate: 4.0" in out
    assert "Burstiness factor: 1.0 (Poisson process)" in out
    rows = parse_block(out)
    for label in [*BLOCK_LABELS, "Request goodput (req/s):", "Request rate configured (RPS):"]:
        assert label in rows, f"{label} missing from:\n{out}"
    values = {k: float(v) for k, v in rows.items()}  # every value parses as a number
    assert values["Successful requests:"] == 50
    assert values["Failed requests:"] == 0
    assert values["Total input tokens:"] == 50 * 32
    assert values["Total generated tokens:"] == 50 * 8
    assert values["Request rate configured (RPS):"] == 4.0
    assert values["Benchmark duration (s):"] >= 12.5  # the last request leaves at 50 / 4 s
    assert 0 < values["Request goodput (req/s):"] <= values["Request throughput (req/s):"]
    assert "Server Timings (pdserve)" in out and "Cached prompt tokens:" in rows

    data = load(result)
    for key in JSON_KEYS:
        assert key in data, key
    assert data["completed"] == 50 and data["failed"] == 0
    assert data["failures_by_status"] == {}
    assert len(data["ttfts"]) == len(data["itls"]) == len(data["errors"]) == 50
    assert data["output_lens"] == [8] * 50
    assert data["input_lens"] == [32] * 50
    assert data["total_output_tokens"] == 400
    assert data["request_rate"] == 4.0 and data["backend"] == "pdserve-grpc"
    assert data["request_goodput"] <= data["request_throughput"]
    assert all(t > 0 for t in data["ttfts"]) and all(e == "" for e in data["errors"])
    assert all(1 <= len(itl) <= 7 for itl in data["itls"])  # chunks after the first
    assert data["mean_ttft_ms"] <= data["mean_e2el_ms"]
    assert data["mean_queue_ms"] >= 0 and data["mean_prefill_ms"] > 0
    assert math.isclose(data["mean_ttft_ms"], float(rows["Mean TTFT (ms):"]), abs_tol=0.01)


def test_prefix_repetition(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "prefix.json"
    rc, out, err = bench(
        capsys,
        "--target",
        target,
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        "8",
        "--prefix-repetition-prefix-len",
        "64",
        "--prefix-repetition-suffix-len",
        "16",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-output-len",
        "4",
        "--max-concurrency",
        "1",
        "--seed",
        "11",
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,90",
        "--disable-tqdm",
        "--save-result",
        "--result-filename",
        str(result),
    )
    assert rc == 0, err
    rows = parse_block(out)
    assert rows["Successful requests:"] == "8"
    assert rows["Maximum request concurrency:"] == "1"
    assert {"P50 TTFT (ms):", "P90 TTFT (ms):", "P90 E2EL (ms):"} <= rows.keys()
    assert "Mean TPOT (ms):" not in rows and "Request goodput (req/s):" not in rows
    data = load(result)
    assert data["input_lens"] == [80] * 8 and data["output_lens"] == [4] * 8
    assert data["max_concurrency"] == 1
    assert data["request_goodput"] is None
    # one at a time, 4 requests per 64-token prefix: later ones reuse its 4 cached blocks
    assert data["cached_tokens"] > 0


def test_a_plan_workload_replays_at_its_own_times(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dataset-name trace`: every request of a `pdserve plan` workload file, each sent at
    its own arrival time with its own lengths, and a prefix group's later turns served from
    the blocks its earlier ones cached (the ids the simulator hashes)."""
    from pdserve.plan.workload import WorkloadRequest, dump

    reqs = [
        WorkloadRequest(0.0, 80, 3, 0, 0),
        WorkloadRequest(0.6, 100, 2, 0, 80),  # the next turn: the whole first prompt + 20
        WorkloadRequest(1.2, 40, 4),
    ]
    dump(reqs, tmp_path / "w.jsonl")
    result = tmp_path / "trace.json"
    t0 = time.perf_counter()
    rc, _, err = bench(
        capsys, "--target", target, "--dataset-name", "trace", "--dataset-path",
        str(tmp_path / "w.jsonl"), "--disable-tqdm", "--save-result", "--result-filename",
        str(result),
    )  # fmt: skip
    assert rc == 0, err
    assert time.perf_counter() - t0 >= 1.2  # the last one waited for its time
    data = load(result)
    assert data["num_prompts"] == 3 and data["dataset_name"] == "trace"
    assert data["input_lens"] == [80, 100, 40] and data["output_lens"] == [3, 2, 4]
    assert data["cached_tokens"] >= 64  # the second turn reused the first's full blocks


def test_a_trace_needs_its_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = bench(capsys, "--target", "127.0.0.1:1", "--dataset-name", "trace")
    assert rc == 2 and "--dataset-path" in err


SHAREGPT = [
    {
        "conversations": [
            {"from": "human", "value": "What is the capital of France and why is it famous?"},
            {"from": "gpt", "value": "Paris is the capital. It is famous for the Eiffel Tower."},
        ]
    },
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Explain prefill and decode disaggregation."},
            {"from": "gpt", "value": "Prefill runs the prompt; decode streams tokens elsewhere."},
            {"from": "human", "value": "And the KV cache?"},
            {"from": "gpt", "value": "It moves between them."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Tell me a short story about a cache block."},
            {"from": "gpt", "value": "Once upon a time a block moved from one worker to another."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "hi there, how are you today?"},
            {"from": "gpt", "value": "ok"},
        ]
    },
    {"conversations": [{"from": "human", "value": "only one turn here"}]},
]


def test_sharegpt(
    target: str,
    home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.tokenizer import Tokenizer
    from pdserve.models import resolve_model

    monkeypatch.setenv("PDSERVE_HOME", str(home))  # the tokenizer is the served preset's
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(SHAREGPT))
    result = tmp_path / "sharegpt-result.json"
    rc, out, err = bench(
        capsys,
        "--target",
        target,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(dataset),
        "--num-prompts",
        "3",
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--result-filename",
        str(result),
    )
    assert rc == 0, err
    assert parse_block(out)["Successful requests:"] == "3"
    data = load(result)
    assert data["tokenizer_id"] == "tiny" and data["dataset_name"] == "sharegpt"
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    usable = SHAREGPT[:3]  # "ok" is under 4 tokens; a single turn has no answer
    humans = [next(t["value"] for t in e["conversations"] if t["from"] == "human") for e in usable]
    gpts = [next(t["value"] for t in e["conversations"] if t["from"] == "gpt") for e in usable]
    # the first human turn and the gpt turn answering it, in the seed's shuffled order
    assert sorted(data["input_lens"]) == sorted(len(tok.encode(h)) for h in humans)
    expected_out = sorted(len(tok.encode(g, add_special_tokens=False)) for g in gpts)
    assert sorted(data["output_lens"]) == expected_out
    assert data["total_output_tokens"] == sum(expected_out)


def test_failures_by_status(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "fail.json"
    argv = [
        "--target",
        target,
        "--num-prompts",
        "5",
        "--random-input-len",
        "4000",  # the tiny model's context is 2048: INVALID_ARGUMENT at the router
        "--random-output-len",
        "8",
        "--disable-tqdm",
        "--save-result",
        "--result-filename",
        str(result),
    ]
    rc, out, err = bench(capsys, *argv, "--max-failure-rate", "0")
    assert rc == 1
    assert "exceeds --max-failure-rate" in err and "INVALID_ARGUMENT x5" in err
    rows = parse_block(out)
    assert rows["Successful requests:"] == "0" and rows["Failed requests:"] == "5"
    data = load(result)
    assert data["completed"] == 0 and data["failed"] == 5
    assert data["failures_by_status"] == {"INVALID_ARGUMENT": 5}
    assert all(e.startswith("INVALID_ARGUMENT: ") for e in data["errors"])
    assert data["output_lens"] == [0] * 5 and data["ttfts"] == [0.0] * 5
    # the default --max-failure-rate (1.0) reports failures without failing the command
    rc, _, _ = bench(capsys, *argv)
    assert rc == 0


def test_openai_backend_against_pdserve_http(
    server: dict[str, str],
    home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(home))  # the served preset's tokenizer: its vocab
    result = tmp_path / "http.json"
    common = ["--base-url", f"http://{server['http']}", "--disable-tqdm", "--save-result"]
    rc, out, err = bench(
        capsys,
        *common,
        "--result-filename",
        str(result),
        "--num-prompts",
        "10",
        "--request-rate",
        "20",
        "--random-input-len",
        "24",
        "--random-output-len",
        "6",
    )
    assert rc == 0, err
    rows = parse_block(out)
    assert rows["Successful requests:"] == "10" and rows["Total generated tokens:"] == "60"
    data = load(result)
    assert data["backend"] == "openai" and data["model_id"] == "tiny"
    assert data["tokenizer_id"] == "tiny"
    assert data["input_lens"] == [24] * 10 and data["output_lens"] == [6] * 10
    assert all(t > 0 for t in data["ttfts"])
    # over the context: the router's INVALID_ARGUMENT is HTTP 400 before any event
    rc, _, err = bench(
        capsys,
        *common,
        "--result-filename",
        str(result),
        "--num-prompts",
        "3",
        "--random-input-len",
        "4000",
        "--max-failure-rate",
        "0",
    )
    assert rc == 1
    assert load(result)["failures_by_status"] == {"HTTP_400": 3}


# ---- no server -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = bench(
        capsys, "--target", f"127.0.0.1:{_free_port()}", "--ready-check-timeout-sec", "0.5"
    )
    assert rc == 1 and "server not ready" in err


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = bench(capsys, "--goodput", "latency:5")
    assert rc == 2 and "--goodput" in err
    rc, _, err = bench(capsys, "--dataset-name", "sharegpt")
    assert rc == 2 and "--dataset-path" in err


def test_arrivals_keep_the_rate() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for burstiness in (0.5, 1.0, 4.0):
        t = arrival_offsets(200, 10.0, burstiness, rng)
        assert t == sorted(t) and t[0] > 0
        assert math.isclose(t[-1], 20.0)  # n / rate, whatever the shape
    assert arrival_offsets(5, float("inf"), 1.0, rng) == [0.0] * 5
    assert arrival_offsets(4, 2.0, float("inf"), rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_metrics_and_goodput() -> None:
    def done(ttft: float, latency: float, n: int) -> RequestOutput:
        o = RequestOutput(success=True, prompt_len=10, output_tokens=n, ttft=ttft)
        o.latency, o.itl = latency, [(latency - ttft) / max(n - 1, 1)] * (n - 1)
        o.token_times = [(ttft, 1)] + [(ttft + (i + 1) * o.itl[0], 1) for i in range(n - 1)]
        return o

    outputs = [
        done(0.1, 1.0, 10),  # TPOT 100 ms
        done(0.5, 0.5, 1),  # TPOT counts as 0 for goodput
        done(3.0, 4.0, 11),  # TTFT over the SLO
        RequestOutput(status="UNAVAILABLE", error="UNAVAILABLE: gone"),
    ]
    m = calculate_metrics(outputs, 2.0, [50.0, 99.9], parse_goodput(["ttft:2000", "tpot:150"]))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["failures_by_status"] == {"UNAVAILABLE": 1}
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 22
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # only outputs with > 1 token
    assert m["median_ttft_ms"] == pytest.approx(500.0)
    assert "p99.9_ttft_ms" in m and "p50_e2el_ms" in m
    assert m["mean_queue_ms"] is None  # no server timings
    text = format_result(m, 2.0, ["ttft", "tpot"], [50.0, 99.9], 4.0, 8, False)
    rows = parse_block(text)
    assert rows["P99.9 TTFT (ms):"] == f"{m['p99.9_ttft_ms']:.2f}"
    assert rows["Maximum request concurrency:"] == "8"
    assert "Mean ITL (ms):" not in rows
    name = default_result_filename("pdserve-grpc", 4.0, 8, "models/tiny", "20250101-000000")
    assert name == "pdserve-grpc-4.0qps-concurrency8-tiny-20250101-000000.json"
    assert (
        default_result_filename("openai", float("inf"), None, "m", "d") == "openai-infqps-m-d.json"
    )


# ---- against a fake OpenAI-compatible server -----------------------------------------------
class FakeOpenAI:
    """`/v1/models` and streaming `/v1/completions` (one token per SSE chunk) on aiohttp."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.requests: list[dict[str, Any]] = []
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30)

    def _serve(self, started: threading.Event) -> None:
        from aiohttp import web

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "fake-model", "max_model_len": 2048}]})

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.requests.append(body)
            n = int(body["max_tokens"])
            if n > 100:
                return web.json_response({"error": "max_tokens too large"}, status=400)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 16},
            }
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = self.runner.addresses[0][1]

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_openai_http_backend(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(home))  # --tokenizer tiny: its vocab for the ids
    fake = FakeOpenAI()
    try:
        url = f"http://127.0.0.1:{fake.port}"
        result = tmp_path / "http.json"
        common = ["--base-url", url, "--tokenizer", "tiny", "--num-prompts", "6", "--disable-tqdm"]
        rc, out, err = bench(
            capsys,
            *common,
            "--random-input-len",
            "20",
            "--random-output-len",
            "5",
            "--request-rate",
            "50",
            "--burstiness",
            "0.5",
            "--save-result",
            "--result-filename",
            str(result),
        )
        assert rc == 0, err
        assert "Burstiness factor: 0.5 (Gamma distribution)" in out
        rows = parse_block(out)
        assert rows["Successful requests:"] == "6" and rows["Total generated tokens:"] == "30"
        assert "Server Timings (pdserve)" not in out
        data = load(result)
        assert data["backend"] == "openai" and data["model_id"] == "fake-model"
        assert data["output_lens"] == [5] * 6 and data["input_lens"] == [20] * 6
        assert all(len(itl) == 4 for itl in data["itls"])
        assert data["cached_tokens"] == 6 * 16 and data["mean_queue_ms"] is None
        sent = fake.requests[-1]
        assert sent["model"] == "fake-model" and sent["stream"] is True
        assert sent["ignore_eos"] is True and sent["max_tokens"] == 5
        assert all(4 <= t < 512 for t in sent["prompt"])

        rc, _, err = bench(
            capsys,
            *common,
            "--random-output-len",
            "200",
            "--save-result",
            "--result-filename",
            str(result),
            "--max-failure-rate",
            "0.5",
        )
        assert rc == 1
        assert load(result)["failures_by_status"] == {"HTTP_400": 6}
    finally:
        fake.close()


def test_stalls_measure_a_blocked_loop_and_leave_the_rest() -> None:
    """`pdserve chaos`'s `Stalls` (the load generator's own waits, left out of a rejection's
    time): a loop blocked 80 ms is recorded as one stall of at least that much, and a span
    that misses it holds none of it."""
    from pdserve.tools.chaos import Stalls

    async def run() -> Stalls:
        stalls = Stalls(time.perf_counter)
        ticker = asyncio.ensure_future(stalls.run())
        await asyncio.sleep(0.02)
        time.sleep(0.08)  # the loop cannot run: as a descheduled process
        await asyncio.sleep(0.02)
        ticker.cancel()
        return stalls

    stalls = asyncio.run(run())
    longest = max(stalls.spans, key=lambda s: s[1] - s[0])
    assert longest[1] - longest[0] >= 0.07
    assert stalls.within(longest[0] - 1.0, longest[1] + 1.0) >= 0.07
    assert stalls.within(longest[1] + 0.5, longest[1] + 1.0) == 0.0
    assert stalls.within(longest[0], longest[0] + 0.01) == pytest.approx(0.01)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_closed_loops_rate_is_its_steady_requests_by_littles_law(seed: int) -> None:
    """`pdserve chaos`'s capacity: a closed loop of 48 in flight at 50 requests/s (each
    steady request 0.96 s from send to end), whose first and last 48 ran faster with fewer
    in flight and whose last ones end in one burst, is measured at 50 requests/s: the ramp
    and the tail are left out, and no burst's place decides it."""
    from pdserve.tools.chaos import OK, Outcome, steady_throughput

    rng = random.Random(seed)
    outs = []
    for i in range(768):
        sent = i / 50.0 + rng.uniform(0.0, 0.01)
        steady = 48 <= i < 768 - 48
        latency = 0.96 * rng.uniform(0.8, 1.2) if steady else 0.3
        end = min(sent + latency, 768 / 50.0) if i >= 768 - 48 else sent + latency
        outs.append(Outcome(f"r{i}", sent_s=sent, status=OK, ended_s=end))
    rng.shuffle(outs)
    assert steady_throughput(outs, 48) == pytest.approx(50.0, rel=0.05)
    assert steady_throughput(outs[:90], 48) == 0.0  # no steady part: no rate
