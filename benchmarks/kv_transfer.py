#!/usr/bin/env python
"""KV-transfer benchmark: transport throughput vs raw ceilings, and the transfer's share of TTFT.

Run: ``.venv/bin/python benchmarks/kv_transfer.py`` (``make bench-transfer``). One run prints:

1. **Throughput.** GB/s (1 GB = 1e9 B) of each transport moving 8, 64 and 512 MiB of KV pages
   between two spawned processes over loopback (a sender and a receiver, each with its own
   preallocated `PagedKVCache`), timed from `KVSender.start` to the receiver's acknowledgement,
   on a warm pair (one warm-up transfer, then `--reps` timed ones; median and best). Beside
   them, ceilings measured in the same run between the same two processes: one contiguous gloo
   send of the same bytes (plus a one-element ack back), and a raw gRPC client stream of 1 MiB
   ``bytes`` messages (generic handler, identity serializers, no protobuf). The in-process
   ``local`` transport is compared with a one-process ``torch`` copy of the same byte count.
2. **TTFT share.** The ``small`` preset (bf16) prefills 512- and 2048-token prompts in the
   sender process (``prefill_only=True``, whole prompt in one step) and ships the prompt's
   pages to a receiver process that reserved blocks, either layer by layer from
   ``engine.layer_hook`` (``KVSender.push_async``, the prefill worker's path: frames go out on the
   sender's thread) while later layers compute (overlap) or all at once after prefill (no
   overlap). TTFT = prefill start -> transfer acknowledged. Each round runs, per transport and
   prompt length, a prefill-only run, an overlap run and a no-overlap run back to back (the
   overlap run in the middle, the order flipped every round); the
   added share is the median over rounds of ``(TTFT - prefill) / prefill`` within a round
   (paired, so the box's drift between rounds cancels). The unpaired figure (median TTFT
   against median prefill over all rounds) is in the JSON too.

Results go to ``benchmarks/results/kv_transfer-latest.{json,png}``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PDSERVE_HOME", str(ROOT / ".venv" / "pdserve-home"))  # as the Makefile

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.block_manager import BlockManager  # noqa: E402
from engine.config import CacheConfig, ModelConfig, ceil_div  # noqa: E402
from engine.kv_cache import PagedKVCache  # noqa: E402
from engine.scheduler import SchedulerOutput  # noqa: E402
from kv_transfer.probe import (  # noqa: E402
    HOST,
    PageReceiver,
    PageSender,
    PeerProcess,
    checksum,
    page_cache,
)
from kv_transfer.receiver import KVReceiver  # noqa: E402
from kv_transfer.sender import KVSender, OutboundTransfer  # noqa: E402
from kv_transfer.transports.base import get_transport  # noqa: E402
from kv_transfer.wire import block_runs  # noqa: E402
from pdserve.plan.device import GEOMETRIES  # noqa: E402
from protos.pdserve.v1 import kv_transfer_pb2 as pb  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
MIB = 1 << 20
GB = 1e9
CHUNK_BYTES = 1 << 20  # raw gRPC message size, as the grpc transport's data chunks
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]
TRANSFER_TIMEOUT_S = 120.0
TARGET_GLOO = 0.8
TARGET_GRPC = 0.6
TARGET_TTFT_SHARE = 0.02

# Page geometry for the throughput part: Llama-3-8B's layout (32 layers, 8 KV heads of
# 128 dims, bf16, 16-token blocks). One page (K+V of one block of one layer) is 64 KiB, one
# block of all layers 2 MiB, so 8/64/512 MiB are 4/32/256 blocks and a layer's K (or V) run is
# 128 KiB / 1 MiB / 8 MiB.
GEOMETRY: dict[str, Any] = GEOMETRIES["llama-3-8b"]
BLOCK_SIZE = 16


def page_model() -> ModelConfig:
    return ModelConfig.from_hf_dict(GEOMETRY)


def block_bytes_all_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers * 2 * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 2  # bf16


def split_bytes(buf: torch.Tensor, nbytes: int, messages: int) -> list[torch.Tensor]:
    """The first `nbytes` of `buf` as `messages` equal contiguous slices."""
    assert nbytes % messages == 0, (nbytes, messages)
    step = nbytes // messages
    return [buf[i * step : (i + 1) * step] for i in range(messages)]


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


class _RawSink:
    """Raw gRPC receiver: a client stream of bytes messages, optionally landed in a buffer."""

    def __init__(self, buf: np.ndarray, land: bool) -> None:
        self.buf = buf
        self.land = land

    def push(self, request_iterator: Iterator[bytes], context: Any) -> bytes:
        n = 0
        for msg in request_iterator:
            if self.land:
                self.buf[n : n + len(msg)] = np.frombuffer(msg, np.uint8)
            n += len(msg)
        return n.to_bytes(8, "little")


class RxPeer(PageReceiver):
    """The decode side: caches, receivers and endpoints; a gloo rank 1; a raw gRPC server."""

    def __init__(self) -> None:
        super().__init__()
        self.store: Any = None
        self.pg: Any = None
        self.buf: torch.Tensor | None = None
        self.servers: list[Any] = []

    def ttft_listen(self, model_dir: str, fingerprint: str, transport: str, blocks: int) -> str:
        cache = PagedKVCache(
            ModelConfig.from_hf(model_dir),
            CacheConfig(BLOCK_SIZE, blocks),
            torch.bfloat16,
            fingerprint=fingerprint,
        )
        return self.listen_on(f"ttft-{transport}", transport, cache, "live")

    # ---- raw gloo ------------------------------------------------------------------------
    def gloo_store(self, max_bytes: int) -> int:
        import torch.distributed as dist

        self.store = dist.TCPStore(HOST, 0, None, True, wait_for_workers=False)
        self.buf = torch.zeros(max_bytes, dtype=torch.uint8)
        return int(self.store.port)

    def gloo_pg(self) -> None:
        import datetime

        import torch.distributed as dist

        self.pg = dist.ProcessGroupGloo(
            dist.PrefixStore("raw", self.store), 1, 2, datetime.timedelta(seconds=60)
        )

    def gloo_run(self, nbytes: int, iters: int, messages: int = 1) -> None:
        assert self.buf is not None
        ack = torch.ones(1, dtype=torch.uint8)
        for _ in range(iters):
            works = [self.pg.recv([m], 0, 7) for m in split_bytes(self.buf, nbytes, messages)]
            for w in works:
                w.wait()
            self.pg.send([ack], 0, 8).wait()

    # ---- raw gRPC ------------------------------------------------------------------------
    def grpc_raw_listen(self, land: bool) -> str:
        import grpc

        assert self.buf is not None
        sink = _RawSink(self.buf.numpy(), land)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
        handler = grpc.method_handlers_generic_handler(
            "bench.Raw", {"Push": grpc.stream_unary_rpc_method_handler(sink.push)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(f"{HOST}:0")
        server.start()
        self.servers.append(server)
        return f"{HOST}:{port}"

    def close(self) -> None:
        super().close()
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop(None)
        self.servers.clear()


class TxPeer(PageSender):
    """The prefill side: source pages and senders; gloo rank 0; raw gRPC client; the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.pg: Any = None
        self.buf: torch.Tensor | None = None
        self.grpc_channels: dict[str, Any] = {}
        self.engine: Any = None
        self.n = 0

    # ---- raw gloo ------------------------------------------------------------------------
    def gloo_pg(self, port: int, max_bytes: int) -> None:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore(HOST, port, None, False, timeout=datetime.timedelta(seconds=60))
        self.buf = torch.ones(max_bytes, dtype=torch.uint8)
        self.pg = dist.ProcessGroupGloo(
            dist.PrefixStore("raw", store), 0, 2, datetime.timedelta(seconds=60)
        )

    def gloo_run(self, nbytes: int, iters: int, messages: int = 1) -> list[float]:
        assert self.buf is not None
        ack = torch.zeros(1, dtype=torch.uint8)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            works = [self.pg.send([m], 1, 7) for m in split_bytes(self.buf, nbytes, messages)]
            for w in works:
                w.wait()
            self.pg.recv([ack], 1, 8).wait()
            times.append(time.perf_counter() - t0)
        return times

    # ---- raw gRPC ------------------------------------------------------------------------
    def grpc_raw_send(self, address: str, nbytes: int, iters: int) -> list[float]:
        import grpc

        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.ones(nbytes, dtype=torch.uint8)
        if address not in self.grpc_channels:
            self.grpc_channels[address] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        push = self.grpc_channels[address].stream_unary("/bench.Raw/Push")
        flat = self.buf.numpy()

        def messages() -> Iterator[bytes]:
            for off in range(0, nbytes, CHUNK_BYTES):  # one copy out of the buffer, as needed
                yield flat[off : off + CHUNK_BYTES].tobytes()

        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            got = int.from_bytes(push(messages(), timeout=TRANSFER_TIMEOUT_S), "little")
            times.append(time.perf_counter() - t0)
            assert got == nbytes, (got, nbytes)
        return times

    # ---- TTFT ----------------------------------------------------------------------------
    def ttft_setup(self, model_dir: str, threads: int, max_prompt: int, blocks: int) -> str:
        from engine.config import SchedulerConfig
        from engine.engine import EngineConfig, LLMEngine

        cfg = EngineConfig(
            model=model_dir,
            dtype="bfloat16",
            num_threads=threads,
            cache=CacheConfig(BLOCK_SIZE, blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=max_prompt, max_model_len=max_prompt + 16
            ),
        )
        eng = LLMEngine.from_config(cfg)
        torch.set_num_threads(threads)
        self.engine = eng
        self._push: Callable[[int], None] | None = None

        def hook(step: SchedulerOutput, layer: int) -> None:
            # pushes only on the step that completes the prompt
            if self._push is not None and any(c.completes_prompt for c in step.prefill):
                self._push(layer)

        eng.layer_hook = hook
        return str(eng.fingerprint)

    def ttft_run(
        self, transport: str, mode: str, n_tokens: int, ticket: bytes, seed: int
    ) -> dict[str, float]:
        """One prompt: mode "prefill" (no transfer), "overlap" or "after" (no overlap)."""
        from engine.sampling import SamplingParams

        eng = self.engine
        sender = self.sender(f"ttft-{transport}", transport, eng.cache)
        rng = np.random.default_rng(seed)  # a fresh prompt each run: no prefix-cache hits
        ids = rng.integers(10, eng.model_config.vocab_size - 10, n_tokens).tolist()
        self.n += 1
        rid = f"ttft-{self.n}"
        t = pb.TransferTicket.FromString(ticket) if ticket else None
        nblocks = ceil_div(n_tokens, BLOCK_SIZE)
        out: list[OutboundTransfer] = []
        hook_s = [0.0]  # time the compute thread spends inside the layer hook (blocking)

        def push(layer: int) -> None:
            assert t is not None
            h0 = time.perf_counter()
            if not out:
                src = eng.blocks.block_table(rid)[:nblocks]
                out.append(sender.start(t, src))
            sender.push_async(out[0], layer + 1)  # as the prefill worker does
            hook_s[0] += time.perf_counter() - h0

        self._push = push if mode == "overlap" else None
        params = SamplingParams(max_tokens=1, temperature=0.0)
        c0 = time.process_time()
        t0 = time.perf_counter()
        eng.add_request(rid, ids, params, prefill_only=True)
        while eng.has_unfinished():
            eng.step()
        t_prefill = time.perf_counter() - t0
        if mode == "overlap":
            ack = sender.finish(out[0])
        elif mode == "after":
            assert t is not None
            ack = sender.send(t, eng.blocks.block_table(rid)[:nblocks])
        t_total = time.perf_counter() - t0
        cpu = time.process_time() - c0
        self._push = None
        runs = 0
        if t is not None:
            assert ack.status == pb.TRANSFER_STATUS_COMPLETE, ack
            src = eng.blocks.block_table(rid)[:nblocks]
            runs = len(block_runs(src, t.dst_block_ids))
        eng.release(rid)
        return {
            "prefill_s": t_prefill,
            "ttft_s": t_total,
            "tx_cpu_s": cpu,
            "runs": runs,
            "hook_s": hook_s[0],
        }

    def close(self) -> None:
        super().close()
        for ch in self.grpc_channels.values():
            with contextlib.suppress(Exception):
                ch.close()
        self.grpc_channels.clear()


# ======================================================================================
# Parent side
# ======================================================================================


class Peers:
    """Both children; stopped on every exit path (normal, exception, SIGTERM, atexit)."""

    def __init__(self, threads_rx: int, threads_tx: int) -> None:
        ctx = mp.get_context("spawn")
        self.items: list[PeerProcess] = []
        self.gloo_ready = False  # the raw gloo pair (shared by the raw gloo rows) is up
        atexit.register(self.stop, False)
        self.rx = self._add(PeerProcess(ctx, "kvbench-rx", RxPeer, threads_rx))
        self.tx = self._add(PeerProcess(ctx, "kvbench-tx", TxPeer, threads_tx))

    def _add(self, p: PeerProcess) -> PeerProcess:
        self.items.append(p)
        return p

    def stop(self, graceful: bool = True) -> None:
        while self.items:
            self.items.pop().stop(graceful)

    def __enter__(self) -> Peers:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.stop(graceful=exc_type is None)


@dataclass
class Series:
    name: str
    size_mib: int
    times_s: list[float]
    runs: int = 0  # coalesced block runs per layer (regions per layer = 2 x runs)

    @property
    def nbytes(self) -> int:
        return self.size_mib * MIB

    @property
    def gbps_median(self) -> float:
        return self.nbytes / med(self.times_s) / GB

    @property
    def gbps_best(self) -> float:
        return self.nbytes / min(self.times_s) / GB

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "size_mib": self.size_mib,
            "bytes": self.nbytes,
            "times_s": self.times_s,
            "median_s": med(self.times_s),
            "best_s": min(self.times_s),
            "gbps_median": self.gbps_median,
            "gbps_best": self.gbps_best,
            "block_runs_per_layer": self.runs,
        }


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", disable=not enabled, dynamic_ncols=True)

    def step(self, what: str, n: int = 1) -> None:
        self.bar.set_description(what[:40])
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class Case:
    """One row of the throughput table: `once(size_mib, first)` times one transfer."""

    label = ""

    def once(self, size_mib: int, first: bool) -> tuple[float, int]:
        """(seconds, block runs per layer); `first` is the warm-up, checked for integrity."""
        raise NotImplementedError


class MemcpyCase(Case):
    label = "memcpy"

    def __init__(self, max_bytes: int) -> None:
        self.src = torch.ones(max_bytes, dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)

    def once(self, size_mib: int, first: bool) -> tuple[float, int]:
        n = size_mib * MIB
        t0 = time.perf_counter()
        self.dst[:n].copy_(self.src[:n])
        return time.perf_counter() - t0, 0


class LocalCase(Case):
    """The in-process transport between two caches of this process."""

    label = "local"

    def __init__(self, max_blocks: int) -> None:
        cfg = page_model()
        self.src = page_cache(cfg, BLOCK_SIZE, max_blocks)
        self.dst = page_cache(cfg, BLOCK_SIZE, max_blocks)
        self.src.data.normal_()
        self.bpb = block_bytes_all_layers(cfg)
        tr = get_transport("local", timeout_s=TRANSFER_TIMEOUT_S)
        self.rx = KVReceiver(self.dst, BlockManager(max_blocks, BLOCK_SIZE), transport="local")
        self.ep = tr.listen(self.rx)
        self.rx.address = self.ep.address
        self.sender = KVSender(self.src, "bench-local", tr)
        self.n = 0

    def once(self, size_mib: int, first: bool) -> tuple[float, int]:
        nblocks = size_mib * MIB // self.bpb
        self.n += 1
        self.rx.blocks = BlockManager(self.dst.num_blocks, BLOCK_SIZE)
        ticket = self.rx.reserve(f"local-{self.n}", nblocks * BLOCK_SIZE, extra_tokens=0)
        src_ids = list(range(nblocks))
        t0 = time.perf_counter()
        self.sender.send(ticket, src_ids)
        dt = time.perf_counter() - t0
        res = self.rx.take(ticket.transfer_id)
        if first and checksum(self.src, src_ids) != checksum(self.dst, res.dst_block_ids):
            raise AssertionError(f"local {size_mib} MiB: pages arrived corrupted")
        return dt, len(block_runs(src_ids, res.dst_block_ids))

    def close(self) -> None:
        self.sender.close()
        self.ep.close()


class TransportCase(Case):
    """A transport between the two child processes: reserve, send (timed), release."""

    def __init__(self, peers: Peers, name: str, pool: str) -> None:
        self.peers = peers
        self.name = name
        self.key = f"{name}-{pool}"
        self.label = name if pool == "fresh" else f"{name} ({pool} pool)"
        self.bpb = block_bytes_all_layers(page_model())
        peers.rx.call("listen", key=self.key, transport=name, pool=pool)

    def once(self, size_mib: int, first: bool) -> tuple[float, int]:
        rx, tx = self.peers.rx, self.peers.tx
        nblocks = size_mib * MIB // self.bpb
        src_ids = list(range(nblocks))
        ticket = rx.call("reserve", key=self.key, num_tokens=nblocks * BLOCK_SIZE)
        tk = pb.TransferTicket.FromString(ticket)
        dt = tx.call("send", transport=self.name, ticket=ticket, src_ids=src_ids)
        got = rx.call("release", key=self.key, transfer_id=tk.transfer_id, want_checksum=first)
        if first and got != tx.call("checksum", ids=src_ids):
            raise AssertionError(f"{self.label} {size_mib} MiB: pages arrived corrupted")
        return dt, len(block_runs(src_ids, tk.dst_block_ids))


class RawGlooCase(Case):
    """One contiguous gloo send between the children (+ a 1-byte ack back), or with
    `messages` > 1 the same bytes as that many equal sends, all posted at once on both sides:
    the message count a transfer into fresh blocks needs (one K and one V run per layer),
    without the transport's header, checks and ack. The second row separates what gloo
    charges per message from what the protocol adds."""

    def __init__(self, peers: Peers, max_bytes: int, messages: int = 1) -> None:
        self.peers = peers
        self.messages = messages
        self.label = "raw gloo" if messages == 1 else f"raw gloo, {messages} msgs"
        if peers.gloo_ready:
            return
        port = peers.rx.call("gloo_store", max_bytes=max_bytes)
        peers.rx.send("gloo_pg")
        peers.tx.send("gloo_pg", port=port, max_bytes=max_bytes)
        peers.tx.result(120)
        peers.rx.result(120)
        peers.gloo_ready = True

    def once(self, size_mib: int, first: bool) -> tuple[float, int]:
        kw = {"nbytes": size_mib * MIB, "iters": 1, "messages": self.messages}
        self.peers.rx.send("gloo_run", **kw)
        self.peers.tx.send("gloo_run", **kw)
        times = self.peers.tx.result()
        self.peers.rx.result()
        return times[0], 0


class RawGrpcCase(Case):
    """A client stream of 1 MiB bytes messages to a generic handler in the receiver."""

    def __init__(self, peers: Peers, land: bool) -> None:
        self.peers = peers
        self.label = "raw gRPC +land" if land else "raw gRPC"
        self.address = peers.rx.call("grpc_raw_listen", land=land)

    def once(self, size_mib: int, first: bool) -> tuple[float, int]:
        times = self.peers.tx.call(
            "grpc_raw_send", address=self.address, nbytes=size_mib * MIB, iters=1
        )
        return times[0], 0


def run_cases(cases: list[Case], sizes: list[int], reps: int, prog: Progress) -> list[Series]:
    """Every case, rep by rep in turn (a warm-up first): a transport and its ceiling are timed
    seconds apart, so background load drifts hit both alike."""
    out = []
    for size in sizes:
        times: dict[str, list[float]] = {c.label: [] for c in cases}
        runs: dict[str, int] = {c.label: 0 for c in cases}
        for i in range(reps + 1):
            for c in cases:
                dt, r = c.once(size, first=i == 0)
                if i:
                    times[c.label].append(dt)
                    runs[c.label] = max(runs[c.label], r)
            prog.step(f"{size} MiB rep {i}")
        out += [Series(c.label, size, times[c.label], runs[c.label]) for c in cases]
    return out


def bench_ttft(
    peers: Peers,
    transports: list[str],
    prompt_lens: list[int],
    rounds: int,
    threads: int,
    deadline: float,
    prog: Progress,
) -> dict[str, Any]:
    """Rounds of (prefill only, then per transport: overlap, no overlap) per prompt length,
    interleaved so that background load drifts hit every variant alike."""
    from pdserve.models import resolve_model

    model_dir = str(resolve_model("small", dtype="bfloat16"))
    blocks = 4 * ceil_div(max(prompt_lens) + 1, BLOCK_SIZE)
    t_load = time.perf_counter()
    fp = peers.tx.call(
        "ttft_setup",
        model_dir=model_dir,
        threads=threads,
        max_prompt=max(prompt_lens),
        blocks=blocks,
    )
    load_s = time.perf_counter() - t_load
    for tr in transports:
        peers.rx.call(
            "ttft_listen", model_dir=model_dir, fingerprint=fp, transport=tr, blocks=blocks
        )
    base: dict[int, list[dict[str, float]]] = {n: [] for n in prompt_lens}
    runs: dict[str, dict[int, dict[str, list[dict[str, float]]]]] = {
        tr: {n: {"prefill": [], "overlap": [], "after": []} for n in prompt_lens}
        for tr in transports
    }
    seed = 1000

    def one(tr: str, mode: str, n: int) -> dict[str, float]:
        nonlocal seed
        key = f"ttft-{tr}"
        ticket = peers.rx.call("reserve", key=key, num_tokens=n) if mode != "prefill" else b""
        seed += 1
        c0 = peers.rx.call("cpu")
        r: dict[str, float] = peers.tx.call(
            "ttft_run", transport=tr, mode=mode, n_tokens=n, ticket=ticket, seed=seed
        )
        r["rx_cpu_s"] = peers.rx.call("cpu") - c0
        if ticket:
            tid = pb.TransferTicket.FromString(ticket).transfer_id
            peers.rx.call("release", key=key, transfer_id=tid)
        return r

    done = 0
    for rnd in range(rounds + 1):  # round 0 warms the engine and the pairs up
        if rnd > 2 and time.perf_counter() > deadline:
            break  # over the time budget: keep what we have (at least 2 timed rounds)
        for n in prompt_lens:
            # Each transport's three runs back to back, the overlap run in the middle and the
            # order flipped every round, so neither neighbour is always the one that follows
            # an idle gap (on this box the first run of a group is often the slow one).
            order = ("prefill", "overlap", "after") if rnd % 2 else ("after", "overlap", "prefill")
            for tr in transports:
                for mode in order:
                    r = one(tr, mode, n)
                    if rnd:
                        runs[tr][n][mode].append(r)
                        if mode == "prefill":
                            base[n].append(r)
                prog.step(f"TTFT {tr} {n} tok")
        done = rnd
    summary: dict[str, Any] = {
        "model_dir": model_dir,
        "load_s": load_s,
        "rounds_done": done,
        "transports": {},
    }
    mcfg = ModelConfig.from_hf(model_dir)
    for tr, by_len in runs.items():
        rows = []
        for n, modes in by_len.items():
            pre = [r["prefill_s"] for r in base[n]]
            ovl = [r["ttft_s"] for r in modes["overlap"]]
            aft = [r["ttft_s"] for r in modes["after"]]
            prefill, ov, af = med(pre), med(ovl), med(aft)
            # Paired: each round's transfer run against the prefill-only run just before it
            # (same transport, same prompt length), so drift between rounds cancels out.
            own = [r["prefill_s"] for r in modes["prefill"]]
            paired_ovl = [(o - p) / p for o, p in zip(ovl, own, strict=True)]
            paired_aft = [(a - p) / p for a, p in zip(aft, own, strict=True)]
            kv_bytes = ceil_div(n, BLOCK_SIZE) * BLOCK_SIZE * mcfg.kv_bytes_per_token(2)
            cpu = {"tx_prefill_s": med([r["tx_cpu_s"] for r in base[n]])}
            cpu["rx_prefill_s"] = med([r["rx_cpu_s"] for r in base[n]])
            for side in ("tx", "rx"):
                for mode in ("overlap", "after"):
                    cpu[f"{side}_{mode}_s"] = med([r[f"{side}_cpu_s"] for r in modes[mode]])
            rows.append(
                {
                    "prompt_tokens": n,
                    "kv_bytes": kv_bytes,
                    "prefill_only_s": prefill,
                    "ttft_overlap_s": ov,
                    "ttft_no_overlap_s": af,
                    "share_overlap": med(paired_ovl),
                    "share_no_overlap": med(paired_aft),
                    "share_overlap_paired_runs": paired_ovl,
                    "share_overlap_unpaired": (ov - prefill) / prefill,
                    "share_no_overlap_unpaired": (af - prefill) / prefill,
                    "share_overlap_best": (min(ovl) - min(pre)) / min(pre),
                    "share_no_overlap_best": (min(aft) - min(pre)) / min(pre),
                    "overlap_prefill_part_s": med([r["prefill_s"] for r in modes["overlap"]]),
                    "overlap_tail_s": med([r["ttft_s"] - r["prefill_s"] for r in modes["overlap"]]),
                    "overlap_hook_s": med([r["hook_s"] for r in modes["overlap"]]),
                    "no_overlap_tail_s": med(
                        [r["ttft_s"] - r["prefill_s"] for r in modes["after"]]
                    ),
                    "pass": med(paired_ovl) <= TARGET_TTFT_SHARE,
                    "block_runs_per_layer": med([r["runs"] for r in modes["overlap"]]),
                    "cpu": cpu,
                    "per_run": modes,
                }
            )
        summary["transports"][tr] = rows
    return summary


# ---- reporting -----------------------------------------------------------------------------


def by(series: list[Series], name: str, size: int) -> Series | None:
    return next((s for s in series if s.name == name and s.size_mib == size), None)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ratio_pairs(series: list[Series]) -> list[tuple[str, str, float | None]]:
    """(numerator, ceiling, target) rows of the ratio table. The split raw gloo row (if
    measured) adds two untargeted ratios: what the protocol costs over gloo sending the
    same messages, and what gloo charges for splitting the bytes into those messages."""
    pairs: list[tuple[str, str, float | None]] = [
        ("torch_dist", "raw gloo", TARGET_GLOO),
        ("grpc", "raw gRPC", TARGET_GRPC),
        ("local", "memcpy", None),
    ]
    split = sorted({s.name for s in series if s.name.startswith("raw gloo, ")})
    for name in split:
        pairs[1:1] = [("torch_dist", name, None), (name, "raw gloo", None)]
    return pairs


def ratio_rows(series: list[Series], sizes: list[int]) -> list[dict[str, Any]]:
    pairs = ratio_pairs(series)
    rows = []
    for num, den, target in pairs:
        for size in sizes:
            a, b = by(series, num, size), by(series, den, size)
            if a is None or b is None:
                continue
            r_med = a.gbps_median / b.gbps_median
            r_best = a.gbps_best / b.gbps_best
            rows.append(
                {
                    "transport": num,
                    "ceiling": den,
                    "size_mib": size,
                    "ratio_median": r_med,
                    "ratio_best": r_best,
                    "target": target,
                    "pass": None if target is None else r_med >= target,
                }
            )
    return rows


def report(
    series: list[Series], ratios: list[dict[str, Any]], ttft: dict[str, Any] | None, meta: dict
) -> str:
    lines: list[str] = []
    w = lines.append
    w("")
    w("=" * 96)
    w("KV transfer benchmark  " + meta["when"])
    w(
        f"host: {meta['cpus']} CPUs, torch {meta['torch']}, grpc {meta['grpc']}; "
        f"load avg at start {meta['loadavg_start']}"
    )
    w(
        f"pages: bf16, block {BLOCK_SIZE}, {meta['geometry']}; "
        f"one page {meta['page_kib']} KiB, one block of all layers {meta['block_mib']} MiB"
    )
    w(
        f"timing: warm pair, 1 warm-up + {meta['reps']} timed transfers each, start -> ack, "
        "rows interleaved rep by rep; GB/s = 1e9 B/s from the median (best in brackets)"
    )
    w(
        "processes: sender and receiver spawned; torch threads: 1 per child for part 1, "
        "in-process rows (memcpy, local) in the parent with 1 thread"
    )
    w("")
    sizes = meta["sizes_mib"]
    names = []
    for s in series:
        if s.name not in names:
            names.append(s.name)
    head = f"{'GB/s':<30}" + "".join(f"{str(sz) + ' MiB':>20}" for sz in sizes) + "   runs/layer"
    w("1. Throughput")
    w(head)
    w("-" * len(head))
    for name in names:
        cells = []
        for sz in sizes:
            row = by(series, name, sz)
            cells.append(
                f"{row.gbps_median:>9.2f} [{row.gbps_best:>6.2f}]   " if row else f"{'-':>20}"
            )
        runs = [by(series, name, sz) for sz in sizes]
        rtxt = (
            "/".join(str(r.runs) for r in runs if r is not None) if runs[0] and runs[0].runs else ""
        )
        w(f"{name:<30}" + "".join(f"{c:>20}" for c in cells) + f"   {rtxt}")
    w(
        "runs/layer: coalesced block runs per layer; the transfer is one frame of all layers "
        "(KVSender.send: nothing to overlap with) carrying 2 regions (K, V) per run per layer, "
        "one gloo message each"
    )
    w("")
    w(f"{'ratio (median [best])':<30}" + "".join(f"{str(sz) + ' MiB':>20}" for sz in sizes))
    for num, den, _ in ratio_pairs(series):
        rs = [r for r in ratios if r["transport"] == num and r["ceiling"] == den]
        if not rs:
            continue
        cells = []
        for sz in sizes:
            r = next((x for x in rs if x["size_mib"] == sz), None)
            if r is None:
                cells.append("-")
                continue
            tag = "" if r["pass"] is None else f" {verdict(r['pass'])}"
            cells.append(f"{r['ratio_median']:.2f} [{r['ratio_best']:.2f}]{tag}")
        target = rs[0]["target"]
        label = f"{num}/{den}" + (f" >={target}" if target else "")
        w(f"{label:<30}" + "".join(f"{c:>20}" for c in cells))
    if ttft:
        w("")
        w(
            f"2. TTFT share, preset small bf16 ({ttft['model_dir']}), sender torch threads "
            f"{meta['compute_threads']}, receiver 1; {ttft['rounds_done']} interleaved rounds "
            "after a warm-up round; medians"
        )
        w(
            "   (2 cores: the receiver's copies and the transport threads compete with prefill "
            "compute for the same cores)"
        )
        hdr = (
            f"   {'transport':<11}{'tokens':>7}{'KV MiB':>8}{'prefill ms':>12}"
            f"{'TTFT ovl':>10}{'TTFT no-ovl':>13}{'share ovl':>11}{'share no-ovl':>14}"
            f"{'ovl tail':>10}{'no-ovl tail':>13}{'best-of ovl/no-ovl':>20}  share ovl<=2%"
        )
        w(hdr)
        for tr, rows in ttft["transports"].items():
            for r in rows:
                w(
                    f"   {tr:<11}{r['prompt_tokens']:>7}{r['kv_bytes'] / MIB:>8.1f}"
                    f"{r['prefill_only_s'] * 1e3:>12.1f}{r['ttft_overlap_s'] * 1e3:>10.1f}"
                    f"{r['ttft_no_overlap_s'] * 1e3:>13.1f}{r['share_overlap'] * 100:>10.2f}%"
                    f"{r['share_no_overlap'] * 100:>13.2f}%{r['overlap_tail_s'] * 1e3:>10.1f}"
                    f"{r['no_overlap_tail_s'] * 1e3:>13.1f}"
                    f"{r['share_overlap_best'] * 100:>11.1f}%/"
                    f"{r['share_no_overlap_best'] * 100:.1f}%"
                    f"  {verdict(r['pass'])}"
                )
        w(
            "   ms. share = median over rounds of (TTFT - prefill-only) / prefill-only, each "
            "round's runs back to back; best-of: the same from the fastest run of each"
        )
        w(
            "   tail = TTFT minus the prefill part of the same run (transfer time left exposed "
            "after the last layer)"
        )
        w("")
        w("   CPU seconds per request (median; tx = sender process incl. compute, rx = receiver)")
        w(
            f"   {'transport':<11}{'tokens':>7}{'runs/layer':>11}{'tx prefill':>12}{'tx ovl':>9}"
            f"{'tx no-ovl':>11}{'rx idle':>9}{'rx ovl':>9}{'rx no-ovl':>11}{'hook ms':>9}"
        )
        for tr, rows in ttft["transports"].items():
            for r in rows:
                c = r["cpu"]
                w(
                    f"   {tr:<11}{r['prompt_tokens']:>7}{r['block_runs_per_layer']:>11.0f}"
                    f"{c['tx_prefill_s']:>12.3f}{c['tx_overlap_s']:>9.3f}{c['tx_after_s']:>11.3f}"
                    f"{c['rx_prefill_s']:>9.3f}{c['rx_overlap_s']:>9.3f}{c['rx_after_s']:>11.3f}"
                    f"{r['overlap_hook_s'] * 1e3:>9.1f}"
                )
        w(
            "   hook ms: wall time the prefill thread spent blocked inside engine.layer_hook "
            "(KVSender.start and push_async, which only enqueues: the pushes run on the "
            "sender thread, as in the prefill worker) per overlapped request"
        )
    w("=" * 96)
    return "\n".join(lines)


def plot(series: list[Series], ttft: dict[str, Any] | None, sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    for item in series:
        if item.name not in names:
            names.append(item.name)
    ncols = 2 if ttft else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols + 2, 6), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs, ys, errs = [], [], []
        for j, sz in enumerate(sizes):
            row = by(series, name, sz)
            if row is None:
                continue
            xs.append(j + i * width - 0.4 + width / 2)
            ys.append(row.gbps_median)
            errs.append(row.gbps_best - row.gbps_median)
        ceiling = name == "memcpy" or name.startswith("raw ")
        ax.bar(
            xs,
            ys,
            width,
            yerr=[[0] * len(errs), errs],
            label=name,
            hatch="//" if ceiling else None,
            alpha=0.6 if ceiling else 1.0,
            capsize=2,
        )
    ax.set_xticks(range(len(sizes)), [f"{sz} MiB" for sz in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (median; whisker to best)")
    ax.set_title("KV pages between two processes over loopback\n(hatched: raw ceilings)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    ax.grid(axis="y", alpha=0.3, which="both")
    if ttft:
        ax2 = axes[0][1]
        labels, pre, ovl, aft = [], [], [], []
        for tr, rows in ttft["transports"].items():
            for r in rows:
                labels.append(f"{tr}\n{r['prompt_tokens']} tok")
                pre.append(r["prefill_only_s"] * 1e3)
                ovl.append(r["ttft_overlap_s"] * 1e3)
                aft.append(r["ttft_no_overlap_s"] * 1e3)
        x = np.arange(len(labels))
        ax2.bar(x - 0.27, pre, 0.27, label="prefill only")
        ax2.bar(x, ovl, 0.27, label="TTFT, layer-wise overlap")
        ax2.bar(x + 0.27, aft, 0.27, label="TTFT, send after prefill")
        for xi, p, o, a in zip(x, pre, ovl, aft, strict=True):
            ax2.annotate(
                f"{(o - p) / p * 100:+.1f}%", (xi, o), ha="center", va="bottom", fontsize=7
            )
            ax2.annotate(
                f"{(a - p) / p * 100:+.1f}%", (xi + 0.27, a), ha="center", va="bottom", fontsize=7
            )
        ax2.set_xticks(x, labels)
        ax2.set_ylabel("ms (median)")
        ax2.set_title("TTFT of the small preset (bf16) with the KV transfer")
        ax2.legend(fontsize=8)
        ax2.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument(
        "--reps", type=int, default=5, help="timed transfers per point (after 1 warm-up)"
    )
    ap.add_argument(
        "--transports",
        nargs="+",
        default=["torch_dist", "grpc"],
        help="two-process transports (local always runs in-process)",
    )
    ap.add_argument(
        "--scattered",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each transport into scattered destination blocks (every other block "
        "of the pool held, the rest freed in random order): one region per page",
    )
    ap.add_argument(
        "--raw-grpc-land",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a raw gRPC stream that copies into a preallocated buffer",
    )
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--ttft-transports", nargs="+", default=["torch_dist", "grpc"])
    ap.add_argument("--ttft-rounds", type=int, default=7)
    ap.add_argument(
        "--compute-threads",
        type=int,
        default=1,
        help="torch threads of the sender process while it prefills",
    )
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="after this many seconds TTFT stops adding rounds (keeps >= 2): a loaded "
        "2-core host still finishes in under 8 minutes",
    )
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    import grpc

    cfg = page_model()
    bpb = block_bytes_all_layers(cfg)
    for sz in args.sizes_mib:
        if sz * MIB % bpb:
            ap.error(f"--sizes-mib {sz}: must be a multiple of {bpb // MIB} MiB (one block)")
    sizes = sorted(args.sizes_mib)
    max_blocks = max(sizes) * MIB // bpb
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "geometry": f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim}",
        "page_kib": 2 * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * 2 // 1024,
        "block_mib": bpb / MIB,
        "reps": args.reps,
        "sizes_mib": sizes,
        "compute_threads": args.compute_threads,
        "ttft_rounds": args.ttft_rounds,
    }
    n_steps = 2 * len(sizes) * (args.reps + 1)
    if not args.skip_ttft:
        n_steps += (args.ttft_rounds + 1) * len(args.prompt_lens) * len(args.ttft_transports)
    prog = Progress(n_steps, not args.no_progress)

    def on_term(signum: int, frame: Any) -> None:
        print(f"\nsignal {signum}: stopping the sender and receiver processes", file=sys.stderr)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.perf_counter()
    series: list[Series] = []
    ttft = None
    try:
        local = LocalCase(max_blocks)
        try:
            series += run_cases([MemcpyCase(max(sizes) * MIB), local], sizes, args.reps, prog)
        finally:
            local.close()
            del local
        with Peers(threads_rx=1, threads_tx=1) as peers:
            pages: dict[str, Any] = {"model": page_model(), "block_size": BLOCK_SIZE}
            peers.rx.call("setup_pages", num_blocks=2 * max_blocks, **pages)  # for "scattered"
            peers.tx.call("setup_pages", num_blocks=max_blocks, **pages)
            cases: list[Case] = [
                RawGlooCase(peers, max(sizes) * MIB),
                RawGlooCase(peers, max(sizes) * MIB, messages=2 * cfg.num_layers),
                RawGrpcCase(peers, False),
            ]
            if args.raw_grpc_land:
                cases.append(RawGrpcCase(peers, True))
            for name in args.transports:
                cases.append(TransportCase(peers, name, "fresh"))
                if args.scattered:
                    cases.append(TransportCase(peers, name, "scattered"))
            series += run_cases(cases, sizes, args.reps, prog)
            if not args.skip_ttft:
                peers.tx.call("close")  # part 1's pairs and servers go: no idle polling in TTFT
                peers.rx.call("close")
                ttft = bench_ttft(
                    peers,
                    args.ttft_transports,
                    args.prompt_lens,
                    args.ttft_rounds,
                    args.compute_threads,
                    t_start + args.budget_s,
                    prog,
                )
    finally:
        prog.close()
    meta["runtime_s"] = time.perf_counter() - t_start
    meta["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ratios = ratio_rows(series, sizes)
    text = report(series, ratios, ttft, meta)
    print(text)
    print(f"runtime {meta['runtime_s']:.0f} s; load avg at end {meta['loadavg_end']}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "kv_transfer-latest.json"
    png_path = args.out_dir / "kv_transfer-latest.png"
    doc = {
        "meta": meta,
        "throughput": [s.as_dict() for s in series],
        "ratios": ratios,
        "ttft": ttft,
        "targets": {
            "torch_dist_over_raw_gloo": TARGET_GLOO,
            "grpc_over_raw_grpc": TARGET_GRPC,
            "ttft_share_with_overlap": TARGET_TTFT_SHARE,
        },
    }
    json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    plot(series, ttft, sizes, png_path)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
