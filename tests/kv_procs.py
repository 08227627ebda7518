"""Worker processes for the multi-process KV transfer tests (tests/test_kv_transfer_mp.py).

Each worker is a spawned process that builds its own caches, block managers, receivers,
senders and engines, and executes commands sent by the test over a `multiprocessing` pipe:
``(command, args, kwargs)`` in, ``("ok", result)`` or ``("err", traceback)`` out. Tickets
travel as serialized `TransferTicket` bytes, exactly as a router would carry them.

Page contents are a deterministic pattern (seeded randn), so the receiving process can
recompute what the sender's pages hold and compare raw bytes. Every receiving cache also keeps
a *mirror*: what each of its pages should hold (the sentinel pattern it started with, updated
only by verified transfers), so a full-cache comparison proves that nothing was written
anywhere else: not by rejected frames, not by late frames, not outside a reservation.

Helpers here are also used in-process by tests/test_kv_transfer.py.
"""

from __future__ import annotations

import os
import random
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig, ModelConfig, ceil_div
from engine.engine import EngineConfig, LLMEngine
from engine.kv_cache import DTYPES, PagedKVCache
from engine.request import Request
from engine.sampling import SamplingParams
from kv_transfer.receiver import KVReceiver, ReservationState
from kv_transfer.sender import KVSender, OutboundTransfer
from kv_transfer.transports.base import Endpoint, Transport, get_transport
from kv_transfer.wire import (
    TransferError,
    block_runs,
    frame_regions,
    layout_to_pb,
    make_header,
)
from protos.pdserve.v1 import kv_transfer_pb2 as pb

FINGERPRINT = "kv-test-model"
BLOCK_SIZE = 16
NUM_LAYERS = 3


# ---- geometry and page patterns --------------------------------------------------------------
def model_config(
    num_layers: int = NUM_LAYERS, num_kv_heads: int = 2, head_dim: int = 16
) -> ModelConfig:
    """A model config that only sizes caches (no weights): 3 layers, 2 KV heads of 16."""
    return ModelConfig.from_hf_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "vocab_size": 32,
        }
    )


def make_cache(
    dtype: str,
    num_blocks: int,
    *,
    block_size: int = BLOCK_SIZE,
    fingerprint: str = FINGERPRINT,
    device: str = "cpu",
    **model_kw: int,
) -> PagedKVCache:
    return PagedKVCache(
        model_config(**model_kw),
        CacheConfig(block_size, num_blocks),
        DTYPES[dtype],
        device,
        fingerprint,
    )


def pattern(cache: PagedKVCache, seed: int) -> torch.Tensor:
    """The full-cache pattern for `seed` (same shape and dtype as `cache.data`, on CPU)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(cache.data.shape), generator=g).to(cache.dtype)


def fill(cache: PagedKVCache, seed: int) -> None:
    cache.data.copy_(pattern(cache, seed).to(cache.device))


SRC_BLOCKS = 64  # every sending cache in these tests has this many blocks


def source_pages(dtype: str, seed: int, src_ids: Sequence[int]) -> torch.Tensor:
    """``[L, 2, n, Bs, Hkv, D]``: what a sending cache filled with `seed` holds at `src_ids`."""
    return pattern(make_cache(dtype, SRC_BLOCKS), seed)[:, :, list(src_ids)]


def raw(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of `t` (bit-exact comparisons: NaN payloads, -0.0 and all)."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def fragment(blocks: BlockManager, seed: int = 0) -> list[int]:
    """Scramble the free list so reservations get non-contiguous block ids.

    Every block is allocated to a singleton request, then all but every fourth block are
    freed in a shuffled order of groups of three (some ascending, which coalesce into runs,
    some descending). Returns the ids that stay pinned (allocated) for good.
    """
    n = blocks.num_blocks
    for b in range(n):
        blocks.allocate(f"frag-{b}", [], 1)
    assert [blocks.block_table(f"frag-{b}")[0] for b in range(n)] == list(range(n))
    groups = [[b for b in range(g, min(g + 3, n))] for g in range(0, n, 4)]
    rng = random.Random(seed)
    rng.shuffle(groups)
    for i, group in enumerate(groups):
        for b in group if i % 2 == 0 else reversed(group):
            blocks.free(f"frag-{b}")
    pinned = [b for b in range(n) if blocks.has(f"frag-{b}")]
    blocks.check_integrity()
    return pinned


def spread_ids(count: int, offset: int = 0, num_blocks: int = 64) -> list[int]:
    """`count` distinct, non-contiguous source block ids with a coalescable run inside."""
    base = [offset + 1, offset + 2, offset + 7, offset + 5, offset + 11, offset + 12, offset + 13]
    extra = [offset + 17 + 3 * i for i in range(max(0, count - len(base)))]
    ids = [b % num_blocks for b in (base + extra)[:count]]
    assert len(set(ids)) == count, ids
    return ids


def _ticket(data: bytes) -> pb.TransferTicket:
    return pb.TransferTicket.FromString(data)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---- per-process state -----------------------------------------------------------------------
@dataclass
class Rx:
    cache: PagedKVCache
    blocks: BlockManager
    receiver: KVReceiver
    endpoint: Endpoint
    mirror: torch.Tensor  # what every page must hold
    base_free: int
    pinned: list[int]
    tickets: dict[str, pb.TransferTicket] = field(default_factory=dict)


@dataclass
class Tx:
    cache: PagedKVCache
    sender: KVSender
    transport: Transport
    seed: int
    outbound: dict[str, OutboundTransfer] = field(default_factory=dict)


@dataclass
class Engine:
    engine: LLMEngine
    receiver: KVReceiver | None = None
    endpoint: Endpoint | None = None
    sender: KVSender | None = None
    base_free: int = 0
    pending: dict[str, tuple[Request, str]] = field(default_factory=dict)


@dataclass
class State:
    name: str
    rx: dict[str, Rx] = field(default_factory=dict)
    tx: dict[str, Tx] = field(default_factory=dict)
    eng: dict[str, Engine] = field(default_factory=dict)

    def close(self) -> None:
        for t in self.tx.values():
            t.sender.close()
        for r in self.rx.values():
            r.receiver.close()
            r.endpoint.close()
        for e in self.eng.values():
            if e.sender is not None:
                e.sender.close()
            if e.endpoint is not None:
                e.endpoint.close()


COMMANDS: dict[str, Callable[..., Any]] = {}


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    COMMANDS[fn.__name__] = fn
    return fn


@command
def ping(state: State) -> tuple[str, int]:
    return state.name, os.getpid()


# ---- decode side: receivers ------------------------------------------------------------------
@command
def rx_open(
    state: State,
    key: str,
    transport: str,
    dtype: str,
    num_blocks: int = 64,
    timeout_s: float = 2.0,
    seed: int = 999,
    device: str = "cpu",
) -> dict[str, Any]:
    """A receiving cache (sentinel-filled, fragmented pool) listening on `transport`."""
    cache = make_cache(dtype, num_blocks, device=device)
    fill(cache, seed)
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    pinned = fragment(blocks, seed)
    receiver = KVReceiver(cache, blocks, transport=transport)
    endpoint = get_transport(transport, timeout_s, device).listen(receiver)
    receiver.address = endpoint.address
    state.rx[key] = Rx(
        cache, blocks, receiver, endpoint, cache.data.clone(), blocks.num_free_blocks, pinned
    )
    return {"address": endpoint.address, "free": blocks.num_free_blocks, "pinned": pinned}


@command
def rx_reserve(
    state: State, key: str, request_id: str, num_tokens: int, lease_s: float | None = None
) -> bytes:
    rx = state.rx[key]
    ticket = rx.receiver.reserve(request_id, num_tokens, lease_s=lease_s)
    rx.tickets[ticket.transfer_id] = ticket
    return ticket.SerializeToString()


def _await_release(rx: Rx, transfer_id: str, wait_s: float) -> bool:
    """Poll until the receiver forgot `transfer_id` (its blocks are freed)."""
    deadline = time.monotonic() + wait_s
    while rx.receiver.get(transfer_id) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@command
def rx_collect(
    state: State, key: str, transfer_id: str, src_seed: int, src_ids: list[int], wait_s: float
) -> dict[str, Any]:
    """`receiver.wait` for a transfer; on success check every page bit-exactly and free it."""
    rx = state.rx[key]
    ticket = rx.tickets.pop(transfer_id)
    dst = list(ticket.dst_block_ids)
    t0 = time.monotonic()
    try:
        rx.receiver.wait(transfer_id, wait_s)
    except TransferError as e:
        elapsed = time.monotonic() - t0
        rx.tickets[transfer_id] = ticket
        released = _forget(rx, transfer_id, 5.0)
        return {"status": "failed", "error": str(e), "elapsed": elapsed, "released": released}
    elapsed = time.monotonic() - t0
    with rx.receiver.lock:
        res = rx.receiver.take(transfer_id)
        expected = source_pages(rx.cache.spec.dtype, src_seed, src_ids)
        got = rx.cache.data[:, :, dst]
        exact = same_bytes(got, expected)
        rx.mirror[:, :, dst] = expected.to(rx.cache.device)
        rx.blocks.free(res.request_id)
        rx.blocks.check_integrity()
    return {
        "status": "complete",
        "exact": exact,
        "elapsed": elapsed,
        "bytes": res.bytes_received,
        "dst": dst,
    }


@command
def rx_check(state: State, key: str, wait_s: float = 5.0) -> dict[str, Any]:
    """Pool bookkeeping and the whole cache against the mirror (nothing written elsewhere)."""
    rx = state.rx[key]
    deadline = time.monotonic() + wait_s
    while rx.receiver.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    with rx.receiver.lock:
        rx.blocks.check_integrity()
        return {
            "free": rx.blocks.num_free_blocks,
            "base_free": rx.base_free,
            "pending": rx.receiver.pending(),
            "untouched": same_bytes(rx.cache.data, rx.mirror),
            "num_pairs": getattr(rx.endpoint, "num_pairs", None),
            "broken_pairs": getattr(rx.endpoint, "broken_pairs", None),
        }


@command
def rx_progress(
    state: State,
    key: str,
    transfer_id: str,
    min_bytes: int = 0,
    in_flight: bool = False,
    wait_s: float = 10.0,
) -> dict[str, Any]:
    """Wait until a transfer has `min_bytes` landed (or a frame in flight)."""
    rx = state.rx[key]
    deadline = time.monotonic() + wait_s
    while True:
        res = rx.receiver.get(transfer_id)
        if res is None:
            return {"state": "gone"}
        if res.bytes_received >= min_bytes and (res.in_flight > 0 or not in_flight):
            return {
                "state": res.state.value,
                "bytes": res.bytes_received,
                "in_flight": res.in_flight,
            }
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfer {transfer_id}: {res.bytes_received} bytes landed")
        time.sleep(0.002)


def _forget(rx: Rx, transfer_id: str, wait_s: float) -> bool:
    """Wait for a failed transfer's blocks to be freed; what partly landed in them becomes
    the mirror's expectation (it must not change any more: late frames must not land)."""
    released = _await_release(rx, transfer_id, wait_s)
    ticket = rx.tickets.pop(transfer_id, None)
    if released and ticket is not None:
        dst = list(ticket.dst_block_ids)
        with rx.receiver.lock:
            rx.mirror[:, :, dst] = rx.cache.data[:, :, dst]
    return released


@command
def rx_fail(state: State, key: str, transfer_id: str, wait_s: float = 5.0) -> bool:
    """Decode-side cancel; returns once the blocks are back in the pool."""
    rx = state.rx[key]
    rx.receiver.fail(transfer_id, "cancelled by the decode side")
    return _forget(rx, transfer_id, wait_s)


@command
def rx_released(state: State, key: str, transfer_id: str, wait_s: float = 5.0) -> bool:
    """Wait until the transfer failed and its blocks were freed (abort frame, rejection)."""
    return _forget(state.rx[key], transfer_id, wait_s)


# ---- prefill side: senders -------------------------------------------------------------------
@command
def tx_open(
    state: State,
    key: str,
    transport: str,
    dtype: str,
    seed: int,
    timeout_s: float = 2.0,
    max_channels: int = 32,
    device: str = "cpu",
) -> str:
    cache = make_cache(dtype, SRC_BLOCKS, device=device)
    fill(cache, seed)
    tr = get_transport(transport, timeout_s, device)
    sender = KVSender(cache, f"{state.name}/{key}", tr, max_channels=max_channels)
    state.tx[key] = Tx(cache, sender, tr, seed)
    return sender.sender_id


def _send_one(tx: Tx, ticket: pb.TransferTicket, src_ids: Sequence[int]) -> str:
    try:
        ack = tx.sender.send(ticket, src_ids)
    except TransferError as e:
        return _describe(e)
    return str(pb.TransferStatus.Name(ack.status))


@command
def tx_send(
    state: State, key: str, jobs: list[tuple[bytes, list[int]]], concurrent: bool = False
) -> list[str]:
    """Send every job (ticket bytes, source ids); `concurrent`: one thread per job, all
    released at once, sharing this sender and its channels."""
    tx = state.tx[key]
    if not concurrent:
        return [_send_one(tx, _ticket(t), ids) for t, ids in jobs]
    barrier = threading.Barrier(len(jobs))

    def run(job: tuple[bytes, list[int]]) -> str:
        barrier.wait(timeout=30)
        return _send_one(tx, _ticket(job[0]), job[1])

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


@command
def tx_push(state: State, key: str, ticket: bytes, src_ids: list[int], layers: int) -> str:
    """Start a transfer and push its first `layers` layers; the rest is up to later calls."""
    tx = state.tx[key]
    out = tx.sender.start(_ticket(ticket), src_ids)
    tx.sender.push(out, layers)
    tx.outbound[out.ticket.transfer_id] = out
    return out.ticket.transfer_id


@command
def tx_push_partial_frame(state: State, key: str, ticket: bytes, src_ids: list[int]) -> str:
    """Send layer 0's header and only the first region of its payload, then stall mid-frame."""
    tx = state.tx[key]
    out = tx.sender.start(_ticket(ticket), src_ids)
    header = make_header(
        out.ticket.request_id,
        out.ticket.transfer_id,
        tx.cache.spec,
        0,
        1,
        src_ids,
        out.ticket.dst_block_ids,
        tx.sender.sender_id,
    )
    regions = frame_regions(tx.cache, 0, 1, block_runs(src_ids, out.ticket.dst_block_ids), "src")
    tx.sender.connect(out).send_frame(header, regions[:1])
    tx.outbound[out.ticket.transfer_id] = out
    return out.ticket.transfer_id


@command
def tx_finish(state: State, key: str, transfer_id: str, timeout_s: float | None = None) -> str:
    """Push what is left and wait for the ack; how it ended (anything but a TransferError
    escapes as a worker error)."""
    tx = state.tx[key]
    out = tx.outbound.pop(transfer_id)
    try:
        ack = tx.sender.finish(out, timeout_s)
    except TransferError as e:
        return _describe(e)
    return str(pb.TransferStatus.Name(ack.status))


@command
def tx_abort(state: State, key: str, transfer_id: str, reason: str) -> None:
    tx = state.tx[key]
    out = tx.outbound[transfer_id]
    tx.sender.abort(out, reason)
    assert tx.sender.flush(out), "the abort did not run on its lane"


@command
def tx_num_channels(state: State, key: str) -> int:
    return state.tx[key].sender.num_channels


# ---- torch_dist pairing: shared secrets and the endpoint's pair counts -----------------------
@command
def rx_open_with_secret(
    state: State, key: str, secret: str, timeout_s: float = 2.0, seed: int = 999
) -> dict[str, Any]:
    """`rx_open` for a float32 cache on a torch_dist endpoint that requires `secret`."""
    cache = make_cache("float32", 64)
    fill(cache, seed)
    blocks = BlockManager(64, BLOCK_SIZE)
    pinned = fragment(blocks, seed)
    receiver = KVReceiver(cache, blocks, transport="torch_dist")
    endpoint = get_transport("torch_dist", timeout_s, secret=secret).listen(receiver)
    receiver.address = endpoint.address
    state.rx[key] = Rx(
        cache, blocks, receiver, endpoint, cache.data.clone(), blocks.num_free_blocks, pinned
    )
    return {"address": endpoint.address, "free": blocks.num_free_blocks, "pinned": pinned}


@command
def tx_open_with_secret(
    state: State, key: str, secret: str | None, seed: int, timeout_s: float = 2.0
) -> str:
    """`tx_open` for a float32 cache whose torch_dist channels prove `secret`."""
    cache = make_cache("float32", SRC_BLOCKS)
    fill(cache, seed)
    tr = get_transport("torch_dist", timeout_s, secret=secret)
    sender = KVSender(cache, f"{state.name}/{key}", tr)
    state.tx[key] = Tx(cache, sender, tr, seed)
    return sender.sender_id


@command
def rx_pairs(state: State, key: str) -> dict[str, int | None]:
    """The torch_dist endpoint's pair counts (None where the transport keeps none)."""
    endpoint = state.rx[key].endpoint
    names = ("num_pairs", "skipped_pairs", "refused_pairs", "busy_pairs", "broken_pairs")
    return {n: getattr(endpoint, n, None) for n in names}


# How a misconfigured prefill worker's cache differs from the test geometry; the value is the
# field name a rejection must mention.
BAD_LAYOUTS: dict[str, str] = {
    "fingerprint": "model_fingerprint",
    "dtype": "dtype",
    "head_dim": "head_dim",
    "num_kv_heads": "num_kv_heads",
    "block_size": "block_size",
    "num_layers": "num_layers",
}
# Frames with a consistent layout but a broken header; the value is what the rejection says.
BAD_FRAMES: dict[str, str] = {
    "payload_bytes": "payload_bytes",
    "unreserved": "not reserved",
    "duplicate": "repeat",
}


def bad_cache(dtype: str, kind: str, num_blocks: int = 64) -> PagedKVCache:
    """A cache that differs from the test geometry in exactly the field `kind`."""
    other = "bfloat16" if dtype == "float32" else "float32"
    cache = {
        "fingerprint": lambda: make_cache(dtype, num_blocks, fingerprint="another-model"),
        "dtype": lambda: make_cache(other, num_blocks),
        "head_dim": lambda: make_cache(dtype, num_blocks, head_dim=8),
        "num_kv_heads": lambda: make_cache(dtype, num_blocks, num_kv_heads=1),
        "block_size": lambda: make_cache(dtype, num_blocks, block_size=8),
        "num_layers": lambda: make_cache(dtype, num_blocks, num_layers=NUM_LAYERS + 1),
    }[kind]()
    fill(cache, 4242)
    return cache


def bad_frame(
    cache: PagedKVCache, ticket: pb.TransferTicket, src_ids: list[int], kind: str, foreign: int
) -> tuple[pb.KVFrameHeader, list[torch.Tensor]]:
    """Layer 0's frame for `ticket`, broken in one way (its regions match what it claims)."""
    dst = list(ticket.dst_block_ids)
    if kind == "unreserved":
        dst[len(dst) // 2] = foreign
    elif kind == "duplicate":
        dst[-1] = dst[0]
    elif kind != "payload_bytes":
        raise ValueError(kind)
    header = make_header(
        ticket.request_id, ticket.transfer_id, cache.spec, 0, 1, src_ids, dst, "bad-sender"
    )
    if kind == "payload_bytes":
        header.payload_bytes += cache.spec.page_bytes
    return header, frame_regions(cache, 0, 1, block_runs(src_ids, dst), "src")


@command
def tx_send_bad(
    state: State, key: str, ticket: bytes, src_ids: list[int], kind: str, foreign: int = 0
) -> str:
    """Send a transfer that the receiver must reject; returns how `finish` ended."""
    tx = state.tx[key]
    t = _ticket(ticket)
    if kind in BAD_LAYOUTS:  # a misconfigured prefill worker: its own cache, its own layout
        cache = bad_cache(tx.cache.spec.dtype, kind)
        t.layout.CopyFrom(layout_to_pb(cache.spec))  # so its own start() check passes
        sender = KVSender(cache, f"{state.name}/bad-{kind}", tx.transport)
        try:
            return str(pb.TransferStatus.Name(sender.send(t, src_ids).status))
        except TransferError as e:
            return _describe(e)
        finally:
            sender.close()
    out = tx.sender.start(t, src_ids)
    header, regions = bad_frame(tx.cache, t, src_ids, kind, foreign)
    tx.sender.connect(out).send_frame(header, regions)
    out.layers_sent = tx.cache.num_layers  # nothing else follows this frame
    try:
        return str(pb.TransferStatus.Name(tx.sender.finish(out).status))
    except TransferError as e:
        return _describe(e)


# ---- engines ---------------------------------------------------------------------------------
def engine_config(checkpoint: str, num_blocks: int = 64) -> EngineConfig:
    return EngineConfig(model=checkpoint, cache=CacheConfig(BLOCK_SIZE, num_blocks))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@command
def eng_open(
    state: State, key: str, checkpoint: str, role: str, transport: str, timeout_s: float = 5.0
) -> str:
    """A decode engine with a receiver (returns its address) or a prefill engine with a sender."""
    engine = LLMEngine.from_config(engine_config(checkpoint))
    fragment(engine.blocks, seed=7 if role == "decode" else 8)
    e = Engine(engine, base_free=engine.blocks.num_free_blocks)
    tr = get_transport(transport, timeout_s=timeout_s)
    if role == "decode":
        e.receiver = KVReceiver(engine.cache, engine.blocks, transport=transport)
        e.endpoint = tr.listen(e.receiver)
        e.receiver.address = e.endpoint.address
    else:
        e.sender = KVSender(engine.cache, f"{state.name}/{key}", tr)
    state.eng[key] = e
    return e.endpoint.address if e.endpoint else ""


@command
def eng_generate(
    state: State, checkpoint: str, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """Colocated greedy generation, one prompt at a time (the reference)."""
    engine = LLMEngine.from_config(engine_config(checkpoint))
    return [list(engine.generate([p], greedy(max_tokens))[0].output_token_ids) for p in prompts]


@command
def eng_reserve(
    state: State, key: str, request_id: str, prompt: list[int], max_tokens: int
) -> bytes:
    e = state.eng[key]
    assert e.receiver is not None
    req = e.engine.make_request(request_id, prompt, greedy(max_tokens))
    ticket = e.receiver.reserve(request_id, len(prompt))
    e.pending[request_id] = (req, ticket.transfer_id)
    return ticket.SerializeToString()


def prefill_and_send(
    engine: LLMEngine,
    sender: KVSender,
    ticket: pb.TransferTicket,
    prompt: Sequence[int],
    max_tokens: int,
) -> tuple[int, list[int]]:
    """Prefill `prompt` (prefill_only), pushing each layer as it is written; returns the first
    token and the source block ids. The blocks are released after the acknowledgement."""
    rid = ticket.request_id
    n_blocks = ceil_div(len(prompt), engine.cache_config.block_size)
    outbound: list[OutboundTransfer] = []

    def on_layer(step: object, layer: int) -> None:
        if not outbound:
            src = engine.blocks.block_table(rid)[:n_blocks]
            outbound.append(sender.start(ticket, src))
        sender.push(outbound[0], layer + 1)

    engine.layer_hook = on_layer
    try:
        req = engine.add_request(rid, prompt, greedy(max_tokens), prefill_only=True)
        while not req.is_finished:
            engine.step()
    finally:
        engine.layer_hook = None
    assert outbound, "the layer hook never ran"
    src_ids = list(outbound[0].src_block_ids)
    try:
        sender.finish(outbound[0])
    finally:
        engine.release(rid)
        engine.blocks.check_integrity()
    return req.output_token_ids[0], src_ids


@command
def eng_prefill(
    state: State, key: str, ticket: bytes, prompt: list[int], max_tokens: int
) -> tuple[int, list[int]]:
    e = state.eng[key]
    assert e.sender is not None
    return prefill_and_send(e.engine, e.sender, _ticket(ticket), prompt, max_tokens)


def decode_after_transfer(
    engine: LLMEngine,
    receiver: KVReceiver,
    req: Request,
    transfer_id: str,
    first: int,
    wait_s: float,
) -> list[int]:
    """Wait for the KV, take it over and decode to the end; returns every output token."""
    receiver.wait(transfer_id, wait_s)
    # The receiver's threads (its reaper, a failing transfer) touch the block manager under
    # its lock; this thread steps the engine under the same lock.
    with receiver.lock:
        res = receiver.take(transfer_id)
        assert res.state is ReservationState.COMPLETE
        engine.add_prefilled(req, [first])
    while not req.is_finished:
        with receiver.lock:
            engine.step()
    engine.blocks.check_integrity()
    return list(req.output_token_ids)


@command
def eng_decode(
    state: State, key: str, request_id: str, first: int, wait_s: float = 10.0
) -> dict[str, Any]:
    e = state.eng[key]
    assert e.receiver is not None
    req, tid = e.pending.pop(request_id)
    tokens = decode_after_transfer(e.engine, e.receiver, req, tid, first, wait_s)
    return {"tokens": tokens, "free": e.engine.blocks.num_free_blocks, "base_free": e.base_free}


# ---- the command loop ------------------------------------------------------------------------
def serve(conn: Connection, name: str) -> None:
    """Entry point of a worker process: run commands until "exit" or the pipe closes."""
    torch.set_num_threads(1)
    state = State(name)
    try:
        while True:
            try:
                seq, cmd, args, kwargs = conn.recv()
            except EOFError:
                return
            if cmd == "exit":
                conn.send((seq, "ok", None))
                return
            try:
                result = COMMANDS[cmd](state, *args, **kwargs)
            except BaseException:  # report everything, keep serving
                conn.send((seq, "err", traceback.format_exc()))
            else:
                conn.send((seq, "ok", result))
    finally:
        state.close()
