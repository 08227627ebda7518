"""`pdserve bench`: a serving load generator modelled on `vllm bench serve`.

It sends `--num-prompts` requests drawn from a dataset (random token ids, prefix repetition or
a ShareGPT file) at `--request-rate` requests per second (Poisson arrivals, or gamma-distributed
gaps with `--burstiness`), optionally capped at `--max-concurrency` in flight, to a pdserve
router over gRPC (`--target HOST:PORT`) or to an OpenAI-compatible HTTP server (`--base-url`,
streaming `/v1/completions`). It then prints vLLM's "Serving Benchmark Result" block with
vLLM's labels and, with `--save-result`, writes a JSON file with vLLM's keys.

Measurement (client clock, like vLLM): TTFT is request start to the first chunk carrying a
token; ITL is the gap between consecutive chunks that carry tokens; E2EL is request start to
the end of the stream; TPOT is (E2EL - TTFT) / (output tokens - 1). Per-request lists in the
JSON (`ttfts`, `itls`) are in seconds, as in vLLM; summary metrics are in milliseconds.

Differences from vLLM, on purpose:
- the random and prefix_repetition datasets send token ids (drawn from [4, vocab), clear of
  the special tokens) with `ignore_eos` and `max_tokens` = the output length, so input and
  output lengths are exact; vocab size and context length come from the server's GetModelInfo;
- prefix_repetition yields exactly `--num-prompts` requests (prefixes used round-robin);
- the JSON always holds the per-request lists (`input_lens`, `output_lens`, `ttfts`, `itls`,
  `errors`) and the mean/median/std/percentile keys of all four metrics; it adds
  `failures_by_status` (gRPC status code name, `HTTP_<code>`, `FINISH_ABORT` -> count), the
  means of the server-reported timings (`mean_queue_ms`, `mean_prefill_ms`, `mean_transfer_ms`,
  `mean_server_ttft_ms`, `mean_server_decode_ms`) and `cached_tokens` (prompt tokens served
  from a prefix cache, summed over successful requests);
- `--max-failure-rate R` makes the command exit 1 when failed / num_prompts > R; the default
  1.0 never fails on request errors (vLLM has no such flag).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np
from tqdm import tqdm

from pdserve.client import ClientTLS, add_tls_args, auth_metadata, make_request, open_aio_channel
from protos.pdserve.v1 import generation_pb2 as gen
from protos.pdserve.v1 import generation_pb2_grpc as gen_grpc

if TYPE_CHECKING:
    import aiohttp

    from engine.tokenizer import Tokenizer

METRICS = {  # name -> (label, section header), in vLLM's order
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
FIRST_TOKEN_ID = 4  # ids below are special tokens in pdserve's checkpoints
SERVER_TIMINGS = {  # JSON key -> Timings field
    "mean_queue_ms": "queue_ms",
    "mean_prefill_ms": "prefill_ms",
    "mean_transfer_ms": "transfer_ms",
    "mean_server_ttft_ms": "ttft_ms",
    "mean_server_decode_ms": "decode_ms",
}


# ---- arguments ------------------------------------------------------------------------------
def add_cli_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--target",
        default=None,
        help="gRPC HOST:PORT of a pdserve router (default 127.0.0.1:50051)",
    )
    where.add_argument(
        "--base-url",
        default=None,
        help="OpenAI-compatible HTTP server, e.g. http://127.0.0.1:8000 (streams --endpoint)",
    )
    p.add_argument("--endpoint", default="/v1/completions", help="HTTP endpoint (--base-url)")
    p.add_argument(
        "--model",
        default=None,
        help="model name sent with each request (default: the one served)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint directory or preset for counting ShareGPT tokens "
        "(default: with --base-url the server's own, through POST /tokenize; over gRPC "
        "the served model name when it is a preset)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="sent as `authorization: Bearer KEY` (default: env PDSERVE_API_KEY or OPENAI_API_KEY)",
    )
    p.add_argument("--label", default=None, help="result label (default: the backend)")
    add_tls_args(p)  # --tls-ca: TLS to --target, or the CA for an https:// --base-url

    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name",
        default="random",
        choices=["random", "prefix_repetition", "sharegpt", "trace"],
        help="prompt source: random token ids, a shared-prefix set, a ShareGPT file, or a "
        "`pdserve plan` workload trace replayed at its own arrival times",
    )
    d.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON file (sharegpt), or trace .jsonl"
    )
    d.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompt and arrival sampling")
    d.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="random dataset: prompt tokens per request",
    )
    d.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="random dataset: output tokens per request",
    )
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1",
    )
    d.add_argument("--random-prefix-len", type=int, default=0, help="shared prefix tokens")
    d.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        default=256,
        help="prefix_repetition: tokens of each shared prefix",
    )
    d.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        help="prefix_repetition: unique tokens after the prefix",
    )
    d.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="prefix_repetition: distinct prefixes",
    )
    d.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        default=128,
        help="prefix_repetition: output tokens per request",
    )
    d.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="output length of every request (default: the gpt turn's token count)",
    )

    t = p.add_argument_group("traffic")
    t.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second; inf sends all at once (default)",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1: Poisson; <1 burstier; >1 more uniform)",
    )
    t.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (unset: no limit)",
    )
    t.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=60.0,
        help="how long to wait for the server to answer model info",
    )
    t.add_argument("--request-timeout", type=float, default=None, help="seconds per request")
    t.add_argument("--request-id-prefix", default=None, help="default bench-<random>-")

    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    s.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sampling top_p sent with each request (unset: the server's)",
    )
    s.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sampling top_k sent with each request (unset: the server's)",
    )
    s.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly the output length (always on for random and prefix_repetition)",
    )

    r = p.add_argument_group("results")
    r.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:10000 (milliseconds)",
    )
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    r.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    r.add_argument("--save-result", action="store_true", help="write the result JSON")
    r.add_argument("--save-detailed", action="store_true", help="also save generated texts")
    r.add_argument(
        "--result-dir", default=None, help="directory for the JSON result (with --save-result)"
    )
    r.add_argument(
        "--result-filename",
        default=None,
        help="default {label}-{rate}qps[-concurrency{n}]-{model}-{YYYYmmdd-HHMMSS}.json",
    )
    r.add_argument(
        "--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="saved in the JSON"
    )
    r.add_argument(
        "--max-failure-rate",
        type=float,
        default=1.0,
        help="exit 1 when failed / num-prompts exceeds this (default 1.0: never)",
    )
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if math.isnan(ms):
            raise ValueError(f"--goodput {pair!r}: expected KEY:MILLISECONDS")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: KEY must be one of {list(GOODPUT_METRICS)}")
        if ms < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be non-negative")
        out[name] = ms
    return out


def parse_metric_args(metrics: str, percentiles: str) -> tuple[list[str], list[float]]:
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; choose from {list(METRICS)}")
    try:
        ps = [float(p) for p in percentiles.split(",") if p.strip()]
    except ValueError as e:
        raise ValueError(f"--metric-percentiles {percentiles!r}: {e}") from e
    if any(not 0 <= p <= 100 for p in ps):
        raise ValueError("--metric-percentiles: each must be in [0, 100]")
    return names, ps


# ---- datasets -------------------------------------------------------------------------------
@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    request_id: str = ""


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, size=n)]


def _check_vocab(vocab_size: int | None) -> int:
    if vocab_size is None or vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(
            f"token-id datasets need a vocabulary larger than {FIRST_TOKEN_ID} "
            f"(got {vocab_size}); with --base-url, pass --tokenizer"
        )
    return vocab_size


def sample_random(
    rng: np.random.Generator,
    num_requests: int,
    vocab_size: int | None,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    vocab = _check_vocab(vocab_size)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if input_len < 0 or output_len < 1 or prefix_len < 0:
        raise ValueError("--random-input-len/--random-prefix-len >= 0, --random-output-len >= 1")
    in_lo, in_hi = (
        math.floor(input_len * (1 - range_ratio)),
        math.ceil(input_len * (1 + range_ratio)),
    )
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = math.ceil(output_len * (1 + range_ratio))
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    prefix = _ids(rng, prefix_len, vocab)
    out = []
    for n_in, n_out in zip(input_lens, output_lens, strict=True):
        ids = prefix + _ids(rng, int(n_in), vocab)
        out.append(SampleRequest(ids, len(ids), int(n_out)))
    return out


def sample_trace(path: str, vocab_size: int | None, seed: int) -> list[SampleRequest]:
    """A `pdserve plan` workload (`pdserve.plan.workload`): every request of the file, its
    prompt token ids as the simulator builds them (the same seed gives the same ids, so
    prefix groups hit the cache as predicted); the send times are the file's
    (`trace_offsets`)."""
    from pdserve.plan.workload import load, token_ids

    vocab = _check_vocab(vocab_size)
    reqs = load(path)
    return [
        SampleRequest(ids, len(ids), r.output_tokens)
        for r, ids in zip(reqs, token_ids(reqs, vocab, seed), strict=True)
    ]


def trace_offsets(path: str) -> list[float]:
    from pdserve.plan.workload import load

    return [r.arrival_s for r in load(path)]


def sample_prefix_repetition(
    rng: np.random.Generator,
    num_requests: int,
    vocab_size: int | None,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[SampleRequest]:
    vocab = _check_vocab(vocab_size)
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or output_len < 1:
        raise ValueError(
            "--prefix-repetition-num-prefixes and -output-len >= 1, prefix/suffix lengths >= 0"
        )
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        ids = prefixes[i % num_prefixes] + _ids(rng, suffix_len, vocab)
        out.append(SampleRequest(ids, len(ids), output_len))
    order = rng.permutation(len(out))
    return [out[int(i)] for i in order]


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    """The first human turn and the gpt turn that answers it."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") == "human":
            for reply in turns[i + 1 :]:
                if isinstance(reply, dict) and reply.get("from") == "gpt":
                    return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def sample_sharegpt(
    path: str,
    tokenizer: TextTokenizer,
    num_requests: int,
    seed: int,
    output_len: int | None = None,
    max_context_length: int | None = None,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle with the seed, prune like vLLM, oversample if short.

    The prompt length counts what the server will see (the tokenizer adds BOS); the output
    length is the gpt turn's token count without special tokens, or `output_len`.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations")
    pairs = [p for p in map(_first_exchange, data) if p is not None]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(out) >= num_requests:
            break
        n_in = len(tokenizer.encode(prompt))
        n_out = (
            len(tokenizer.encode(completion, add_special_tokens=False))
            if output_len is None
            else output_len
        )
        too_short = n_in < 4 or (output_len is None and n_out < 4)
        too_long = n_in > 1024 or n_in + n_out > 2048
        if max_context_length is not None and n_in + n_out > max_context_length:
            too_long = True
        if too_short or too_long or n_out < 1:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
    if not out:
        raise ValueError(f"--dataset-path {path}: no usable conversation (see the pruning rules)")
    while len(out) < num_requests:
        pick = rng.choice(out)
        out.append(SampleRequest(pick.prompt, pick.prompt_len, pick.expected_output_len))
    return out


class TextTokenizer(Protocol):
    """What sampling needs of a tokenizer: a local one, or the server's (`RemoteTokenizer`)."""

    @property
    def vocab_size(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class RemoteTokenizer:
    """The served model's tokenizer through the server's POST /tokenize: `encode` is called
    from a worker thread (sampling runs in `asyncio.to_thread`) and runs on `loop`."""

    def __init__(
        self, backend: OpenAIBackend, loop: asyncio.AbstractEventLoop, vocab: int | None
    ) -> None:
        self.backend = backend
        self.loop = loop
        self._vocab = vocab

    @property
    def vocab_size(self) -> int | None:
        return self._vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        future = asyncio.run_coroutine_threadsafe(
            self.backend.tokenize(text, add_special_tokens), self.loop
        )
        return future.result()


def load_tokenizer(name_or_dir: str) -> Tokenizer:
    from engine.tokenizer import Tokenizer
    from pdserve.models import resolve_model

    path = resolve_model(name_or_dir)
    if not (path / "tokenizer.json").exists():
        raise ValueError(f"--tokenizer {name_or_dir!r}: no tokenizer.json in {path}")
    return Tokenizer.from_dir(path)


# ---- arrivals -------------------------------------------------------------------------------
def arrival_offsets(
    n: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send time of each request, seconds after the start.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)) (exponential for 1), then
    rescaled so the last request goes out at n / rate: the configured rate holds exactly.
    """
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if request_rate <= 0:
        raise ValueError("--request-rate must be positive")
    if n == 0 or math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return [float(t) for t in times]


# ---- backends -------------------------------------------------------------------------------
@dataclass
class ServedModel:
    name: str
    vocab_size: int | None = None
    max_context_length: int | None = None


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds, request start to end of stream
    start_time: float = 0.0  # perf_counter
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, tokens)
    generated_text: str = ""
    error: str = ""
    status: str = ""  # on failure: gRPC code name, HTTP_<code>, FINISH_ABORT or an exception
    cached_tokens: int = 0
    server_timings: dict[str, float] = field(default_factory=dict)

    def add_chunk(self, now: float, n_tokens: int, text: str) -> None:
        if not self.token_times:
            self.ttft = now - self.start_time
        else:
            self.itl.append(now - self.token_times[-1][0])
        self.token_times.append((now, n_tokens))
        self.output_tokens += n_tokens
        self.generated_text += text


class Backend(Protocol):
    label: str

    async def model_info(self, timeout_s: float) -> ServedModel: ...

    async def generate(self, req: SampleRequest, sampling: dict[str, Any]) -> RequestOutput: ...

    async def close(self) -> None: ...


class GrpcBackend:
    """pdserve.v1.Generation over grpc.aio: one channel, one stream per request."""

    label = "pdserve-grpc"

    def __init__(
        self,
        target: str,
        model: str | None,
        request_timeout_s: float | None,
        api_key: str | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        self.channel = open_aio_channel(target, tls)
        self.stub = gen_grpc.GenerationStub(self.channel)
        self.model = model or ""
        self.timeout_s = request_timeout_s
        self.metadata = auth_metadata(api_key)

    async def model_info(self, timeout_s: float) -> ServedModel:
        try:
            info = await self.stub.GetModelInfo(
                gen.GetModelInfoRequest(),
                timeout=timeout_s,
                wait_for_ready=True,
                metadata=self.metadata,
            )
        except grpc.RpcError as e:
            raise ConnectionError(f"GetModelInfo: {_rpc_error(e)}") from e
        return ServedModel(info.served_model_name, info.vocab_size, info.max_context_length)

    async def generate(self, req: SampleRequest, sampling: dict[str, Any]) -> RequestOutput:
        out = RequestOutput(prompt_len=req.prompt_len)
        request = make_request(req.prompt, request_id=req.request_id, **sampling)
        request.model = self.model
        complete: gen.GenerateComplete | None = None
        out.start_time = time.perf_counter()
        try:
            call = self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)
            async for resp in call:
                now = time.perf_counter()
                if resp.HasField("chunk"):
                    if resp.chunk.token_ids:
                        out.add_chunk(now, len(resp.chunk.token_ids), resp.chunk.text)
                else:
                    complete = resp.complete
            out.latency = time.perf_counter() - out.start_time
        except grpc.RpcError as e:
            out.status, out.error = e.code().name, _rpc_error(e)
            return out
        except Exception as e:
            out.status, out.error = type(e).__name__, str(e)
            return out
        if complete is None:
            out.status, out.error = "INCOMPLETE", "the stream ended without a complete message"
            return out
        if complete.finish_reason == gen.FINISH_REASON_ABORT:
            out.status, out.error = "FINISH_ABORT", "the server aborted the request"
            return out
        out.success = True
        out.prompt_len = complete.usage.prompt_tokens or req.prompt_len
        out.output_tokens = complete.usage.completion_tokens or out.output_tokens
        out.cached_tokens = complete.usage.cached_tokens
        out.server_timings = {
            key: float(getattr(complete.timings, name)) for key, name in SERVER_TIMINGS.items()
        }
        return out

    async def close(self) -> None:
        await self.channel.close()


def _rpc_error(e: grpc.RpcError) -> str:
    code, details = e.code(), e.details()
    return f"{code.name if code else 'UNKNOWN'}: {details}"


class OpenAIBackend:
    """OpenAI-compatible `/v1/completions`, streamed as server-sent events (aiohttp).

    Token-id prompts are sent as a list of ints (which the OpenAI API accepts). Output tokens
    come from the final usage chunk (`stream_options.include_usage`), or else the number of
    content chunks.
    """

    label = "openai"

    def __init__(
        self,
        base_url: str,
        endpoint: str,
        model: str | None,
        request_timeout_s: float | None,
        api_key: str | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        import aiohttp

        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + endpoint
        self.model = model
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=request_timeout_s or 6 * 3600),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            # https:// without --tls-ca checks the server against the system's CAs
            connector=aiohttp.TCPConnector(ssl=tls.ssl_context()) if tls else None,
        )
        self.server_name = tls.server_name if tls else None  # checked in the cert, not the URL's

    async def model_info(self, timeout_s: float) -> ServedModel:
        import aiohttp

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self.session.get(
                    self.base_url + "/v1/models",
                    timeout=aiohttp.ClientTimeout(total=max(deadline - time.monotonic(), 0.1)),
                    server_hostname=self.server_name,
                ) as resp:
                    resp.raise_for_status()
                    body = await resp.json()
                break
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"GET {self.base_url}/v1/models: {e!r}") from e
                await asyncio.sleep(0.5)
        models = body.get("data") or [{}]
        first = next((m for m in models if m.get("id") == self.model), models[0])
        max_len, vocab = first.get("max_model_len"), first.get("vocab_size")  # vocab: pdserve's
        return ServedModel(
            self.model or str(first.get("id", "")),
            int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None,
            int(max_len) if isinstance(max_len, int) else None,
        )

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """The server's token ids for `text` (vLLM's POST /tokenize)."""
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        if self.model:
            body["model"] = self.model
        async with self.session.post(
            self.base_url + "/tokenize", json=body, server_hostname=self.server_name
        ) as resp:
            if resp.status != 200:
                raise ValueError(
                    f"POST {self.base_url}/tokenize: {resp.status} {(await resp.text())[:300]}"
                )
            data = await resp.json()
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise ValueError(f"POST {self.base_url}/tokenize: no token list in the answer")
        return [int(t) for t in tokens]

    async def generate(self, req: SampleRequest, sampling: dict[str, Any]) -> RequestOutput:
        out = RequestOutput(prompt_len=req.prompt_len)
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt,
            "stream": True,
            "stream_options": {"include_usage": True},
            **{k: v for k, v in sampling.items() if v is not None},
        }
        headers = {"x-request-id": req.request_id} if req.request_id else {}
        usage: dict[str, Any] | None = None
        out.start_time = time.perf_counter()
        try:
            async with self.session.post(
                self.url, json=payload, headers=headers, server_hostname=self.server_name
            ) as resp:
                if resp.status != 200:
                    out.status = f"HTTP_{resp.status}"
                    out.error = f"{resp.status} {resp.reason}: {(await resp.text())[:500]}"
                    return out
                async for event in _sse_events(resp):
                    now = time.perf_counter()
                    if event.get("error"):
                        out.status, out.error = "STREAM_ERROR", json.dumps(event["error"])[:500]
                        return out
                    if choices := event.get("choices"):
                        out.add_chunk(now, 1, choices[0].get("text") or "")
                    if event.get("usage"):
                        usage = event["usage"]
            out.latency = time.perf_counter() - out.start_time
        except Exception as e:
            out.status, out.error = type(e).__name__, str(e) or repr(e)
            return out
        if not out.token_times:
            out.status, out.error = "EMPTY_STREAM", "no content chunk arrived"
            return out
        out.success = True
        if usage:
            out.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
            out.output_tokens = int(usage.get("completion_tokens") or out.output_tokens)
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = int(details.get("cached_tokens") or 0)
        return out

    async def close(self) -> None:
        await self.session.close()


async def _sse_events(resp: aiohttp.ClientResponse) -> Any:
    """The JSON objects of a `data: ...` event stream, until `data: [DONE]`."""
    buffer = b""
    async for piece in resp.content.iter_any():
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                return
            if data:
                yield json.loads(data)


# ---- the run --------------------------------------------------------------------------------
async def send_all(
    backend: Backend,
    requests: list[SampleRequest],
    sampling: list[dict[str, Any]],
    offsets: list[float],
    max_concurrency: int | None,
    disable_tqdm: bool,
) -> tuple[list[RequestOutput], float]:
    """Issue each request at its offset; returns the outputs (in order) and the duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = tqdm(total=len(requests), disable=disable_tqdm, file=sys.stderr)

    async def one(req: SampleRequest, params: dict[str, Any]) -> RequestOutput:
        if limit is None:
            out = await backend.generate(req, params)
        else:
            async with limit:
                out = await backend.generate(req, params)
        pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for req, params, offset in zip(requests, sampling, offsets, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, params)))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    pbar.close()
    return outputs, duration


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pXX in milliseconds (0 for an empty list, as vLLM does)."""
    arr = np.asarray(values or [0.0], dtype=np.float64) * 1e3
    out = {
        "mean": float(np.mean(arr)),
        "median": float(np.median(arr)),
        "std": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"p{_p_word(p)}"] = float(np.percentile(arr, p))
    return out


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _peaks(outputs: list[RequestOutput]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket, and the most requests active in one."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    n = math.ceil(max(o.start_time + o.latency for o in ok) - t0) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for o in ok:
        for t, k in o.token_times:
            tokens[min(int(t - t0), n - 1)] += k
        first, last = int(o.start_time - t0), int(o.start_time + o.latency - t0)
        active[first : min(last, n - 1) + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(
    outputs: list[RequestOutput],
    duration_s: float,
    percentiles: list[float],
    goodput: dict[str, float],
) -> dict[str, Any]:
    """vLLM's metrics (keys as in its result JSON) plus pdserve's server-side ones."""
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    total_in = total_out = good = cached = 0
    for o in outputs:
        if not o.success:
            continue
        total_in += o.prompt_len
        total_out += o.output_tokens
        cached += o.cached_tokens
        tpot = 0.0  # output_len <= 1: TPOT counts as 0 for goodput (vLLM)
        if o.output_tokens > 1:
            tpot = (o.latency - o.ttft) / (o.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(o.ttft)
        itls.extend(o.itl)
        e2els.append(o.latency)
        slo = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
        if goodput and all(slo[k] * 1e3 <= ms for k, ms in goodput.items()):
            good += 1
    completed = len(ttfts)
    peak_tokens, peak_active = _peaks(outputs)
    m: dict[str, Any] = {
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats(values, percentiles).items():
            m[f"{stat}_{name}_ms"] = value
    for key in SERVER_TIMINGS:
        vals = [o.server_timings[key] for o in outputs if o.success and key in o.server_timings]
        m[key] = float(np.mean(vals)) if vals else None
    m["cached_tokens"] = cached
    m["failures_by_status"] = dict(Counter(o.status for o in outputs if not o.success))
    return m


def _row(label: str, value: Any, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_result(
    m: dict[str, Any],
    duration_s: float,
    selected: list[str],
    percentiles: list[float],
    request_rate: float,
    max_concurrency: int | None,
    with_server_timings: bool,
) -> str:
    """vLLM's "Serving Benchmark Result" block (same labels, widths and separators)."""
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Successful requests:", m["completed"]),
        _row("Failed requests:", m["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [
        _row("Benchmark duration (s):", duration_s, ".2f"),
        _row("Total input tokens:", m["total_input_tokens"]),
        _row("Total generated tokens:", m["total_output_tokens"]),
        _row("Request throughput (req/s):", m["request_throughput"], ".2f"),
    ]
    if m["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", m["request_goodput"], ".2f"))
    lines += [
        _row("Output token throughput (tok/s):", m["output_throughput"], ".2f"),
        _row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f"),
        _row("Peak concurrent requests:", m["max_concurrent_requests"], ".2f"),
        _row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f"),
    ]
    for name, (label, header) in METRICS.items():
        if name not in selected:
            continue
        lines += [
            "{s:{c}^{n}}".format(s=header, n=50, c="-"),
            _row(f"Mean {label} (ms):", m[f"mean_{name}_ms"], ".2f"),
            _row(f"Median {label} (ms):", m[f"median_{name}_ms"], ".2f"),
        ]
        for p in percentiles:
            w = _p_word(p)
            lines.append(_row(f"P{w} {label} (ms):", m[f"p{w}_{name}_ms"], ".2f"))
    if with_server_timings and m["mean_queue_ms"] is not None:
        lines += [
            "{s:{c}^{n}}".format(s="Server Timings (pdserve)", n=50, c="-"),
            _row("Mean queue (ms):", m["mean_queue_ms"], ".2f"),
            _row("Mean prefill (ms):", m["mean_prefill_ms"], ".2f"),
            _row("Mean KV transfer (ms):", m["mean_transfer_ms"], ".2f"),
            _row("Mean server TTFT (ms):", m["mean_server_ttft_ms"], ".2f"),
            _row("Cached prompt tokens:", m["cached_tokens"]),
        ]
    lines.append("=" * 50)
    return "\n".join(lines)


def default_result_filename(
    label: str, request_rate: float, max_concurrency: int | None, model: str, when: str
) -> str:
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    base_model = model.rstrip("/").split("/")[-1] or "model"
    return f"{label}-{request_rate}qps{conc}-{base_model}-{when}.json"


def _validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not 0.0 <= args.max_failure_rate <= 1.0:
        raise ValueError("--max-failure-rate must be in [0, 1]")
    if args.dataset_name in ("sharegpt", "trace") and not args.dataset_path:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name not in ("sharegpt", "trace") and args.dataset_path:
        raise ValueError(f"--dataset-path is not used by --dataset-name {args.dataset_name}")
    for item in args.metadata or []:
        if "=" not in item:
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")


def _samples(
    args: argparse.Namespace, served: ServedModel, tokenizer: TextTokenizer | None
) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    vocab = served.vocab_size or (tokenizer.vocab_size if tokenizer else None)
    if args.dataset_name == "random":
        return sample_random(
            rng,
            args.num_prompts,
            vocab,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
        )
    if args.dataset_name == "prefix_repetition":
        return sample_prefix_repetition(
            rng,
            args.num_prompts,
            vocab,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
        )
    if args.dataset_name == "trace":
        return sample_trace(args.dataset_path, vocab, args.seed)
    assert tokenizer is not None
    return sample_sharegpt(
        args.dataset_path,
        tokenizer,
        args.num_prompts,
        args.seed,
        args.sharegpt_output_len,
        served.max_context_length,
    )


async def _tokenizer(
    args: argparse.Namespace, backend: Backend, served: ServedModel
) -> TextTokenizer | None:
    """Over HTTP without `--tokenizer`, the server's own (POST /tokenize, called only when
    ShareGPT counts tokens). Else `--tokenizer`, or the served model's when it names a
    preset, loaded only when the run needs one (ShareGPT, or no vocabulary from the server)."""
    if isinstance(backend, OpenAIBackend) and not args.tokenizer:
        if backend.model is None:
            backend.model = served.name
        return RemoteTokenizer(backend, asyncio.get_running_loop(), served.vocab_size)
    needs_tokenizer = args.dataset_name == "sharegpt" or served.vocab_size is None
    if not needs_tokenizer:
        return None
    if args.tokenizer:
        return await asyncio.to_thread(load_tokenizer, args.tokenizer)
    if served.name:
        return await asyncio.to_thread(load_tokenizer, served.name)
    raise ValueError("this run needs a tokenizer: pass --tokenizer")


async def bench_async(args: argparse.Namespace) -> int:
    _validate(args)
    goodput = parse_goodput(args.goodput)
    selected, percentiles = parse_metric_args(args.percentile_metrics, args.metric_percentiles)
    arrival_rng = np.random.default_rng(args.seed + 1)
    if args.dataset_name == "trace":  # every request of the file, at its own time
        offsets = trace_offsets(args.dataset_path)
        args.num_prompts = len(offsets)
    else:
        offsets = arrival_offsets(args.num_prompts, args.request_rate, args.burstiness, arrival_rng)
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    tls = ClientTLS.from_args(args)
    backend: Backend
    if args.base_url:
        backend = OpenAIBackend(
            args.base_url, args.endpoint, args.model, args.request_timeout, api_key, tls
        )
    else:
        target = args.target or "127.0.0.1:50051"
        backend = GrpcBackend(target, args.model, args.request_timeout, api_key, tls)
    try:
        try:
            served = await backend.model_info(args.ready_check_timeout_sec)
        except ConnectionError as e:
            print(f"pdserve bench: server not ready: {e}", file=sys.stderr)
            return 1
        tokenizer_id = args.tokenizer or served.name
        tokenizer = await _tokenizer(args, backend, served)
        requests = await asyncio.to_thread(_samples, args, served, tokenizer)
        prefix = args.request_id_prefix
        if prefix is None:
            prefix = f"bench-{uuid.uuid4().hex[:8]}-"
        for i, req in enumerate(requests):
            req.request_id = f"{prefix}{i}"
        synthetic = args.dataset_name in ("random", "prefix_repetition", "trace")
        ignore_eos = True if synthetic else (True if args.ignore_eos else None)
        sampling = [
            {
                "max_tokens": r.expected_output_len,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "ignore_eos": ignore_eos,
            }
            for r in requests
        ]
        if isinstance(backend, OpenAIBackend) and backend.model is None:
            backend.model = served.name
        label = args.label or backend.label
        distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {args.max_concurrency}", flush=True)
        outputs, duration = await send_all(
            backend, requests, sampling, offsets, args.max_concurrency, args.disable_tqdm
        )
    finally:
        await backend.close()

    metrics = calculate_metrics(outputs, duration, percentiles, goodput)
    print(
        format_result(
            metrics,
            duration,
            selected,
            percentiles,
            args.request_rate,
            args.max_concurrency,
            isinstance(backend, GrpcBackend),
        ),
        flush=True,
    )
    failed = metrics["failed"]
    if failed:
        first = next(o for o in outputs if not o.success)
        counts = ", ".join(f"{k} x{v}" for k, v in metrics["failures_by_status"].items())
        print(
            f"pdserve bench: {failed} of {len(outputs)} requests failed ({counts}); "
            f"first error: {first.error}",
            file=sys.stderr,
        )

    if args.save_result:
        when = datetime.now().strftime("%Y%m%d-%H%M%S")
        result: dict[str, Any] = {
            "date": when,
            "backend": backend.label,
            "label": label,
            "model_id": served.name,
            "tokenizer_id": tokenizer_id if tokenizer is not None else None,
            "dataset_name": args.dataset_name,
            "num_prompts": args.num_prompts,
        }
        for item in args.metadata or []:
            key, _, value = item.partition("=")
            result[key.strip()] = value.strip()
        result.update(
            request_rate=args.request_rate if not math.isinf(args.request_rate) else "inf",
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            duration=duration,
            **metrics,
            input_lens=[o.prompt_len for o in outputs],
            output_lens=[o.output_tokens if o.success else 0 for o in outputs],
            ttfts=[o.ttft for o in outputs],
            itls=[o.itl for o in outputs],
            errors=[o.error for o in outputs],
        )
        if args.save_detailed:
            result["generated_texts"] = [o.generated_text for o in outputs]
        name = args.result_filename or default_result_filename(
            label, args.request_rate, args.max_concurrency, served.name, when
        )
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            name = os.path.join(args.result_dir, name)
        with open(name, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"pdserve bench: wrote {name}", file=sys.stderr)

    rate = failed / len(outputs)
    if rate > args.max_failure_rate:
        print(
            f"pdserve bench: failure rate {rate:.3f} exceeds --max-failure-rate "
            f"{args.max_failure_rate}",
            file=sys.stderr,
        )
        return 1
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return asyncio.run(bench_async(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench", description=__doc__)
    add_cli_args(parser)
    try:
        return run_bench(parser.parse_args(argv))
    except ValueError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
