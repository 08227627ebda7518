"""KV transfer in one process: header checks, late frames, leases, fuzzing, the local
transport, an engine continuing from transferred KV, imports, CUDA and generated code.

The multi-process tests over real sockets are in tests/test_kv_transfer_mp.py; the cache
geometry and page patterns shared by both are in tests/kv_procs.py.
"""

from __future__ import annotations

import filecmp
import functools
import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_procs

from engine.block_manager import BlockManager
from engine.engine import LLMEngine
from engine.kv_cache import PagedKVCache
from kv_transfer import auth
from kv_transfer.config import TransferConfig
from kv_transfer.receiver import KVReceiver, ReservationState
from kv_transfer.sender import KVSender, SenderLeases
from kv_transfer.transports.base import Endpoint, get_transport
from kv_transfer.transports.grpc_stream import (
    GrpcEndpoint,
    consume_stream,
    decode_chunk,
    encode_data_chunk,
    frame_chunks,
)
from kv_transfer.transports.torch_dist import TorchDistEndpoint
from kv_transfer.wire import (
    TransferError,
    TransferRejected,
    TransferUnauthenticated,
    block_runs,
    frame_regions,
    layout_to_pb,
    make_header,
    payload_bytes,
)
from protos.pdserve.v1 import WIRE_VERSION
from protos.pdserve.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
L = kv_procs.NUM_LAYERS
BS = kv_procs.BLOCK_SIZE
RX_BLOCKS = 16
SRC_SEED = 11
RX_SEED = 99


class Rx:
    """A receiving cache (sentinel pattern), a fragmented pool and a receiver over them."""

    def __init__(
        self, dtype: str = "float32", num_blocks: int = RX_BLOCKS, lease_s: float = 30.0
    ) -> None:
        self.cache = kv_procs.make_cache(dtype, num_blocks)
        kv_procs.fill(self.cache, RX_SEED)
        self.blocks = BlockManager(num_blocks, BS)
        self.pinned = kv_procs.fragment(self.blocks)
        self.base_free = self.blocks.num_free_blocks
        self.receiver = KVReceiver(self.cache, self.blocks, lease_s=lease_s, transport="local")

    def snapshot(self) -> torch.Tensor:
        return self.cache.data.clone()

    def changed_blocks(self, before: torch.Tensor) -> set[int]:
        """Block ids whose bytes differ from `before` in any layer, K or V."""
        now = kv_procs.raw(self.cache.data.transpose(0, 2).reshape(self.cache.num_blocks, -1))
        old = kv_procs.raw(before.transpose(0, 2).reshape(self.cache.num_blocks, -1))
        return {b for b in range(self.cache.num_blocks) if not torch.equal(now[b], old[b])}

    def assert_released(self) -> None:
        self.blocks.check_integrity()
        assert self.receiver.pending() == 0
        assert self.blocks.num_free_blocks == self.base_free


@functools.cache
def src_cache(dtype: str = "float32", seed: int = SRC_SEED) -> PagedKVCache:
    """A sending cache (shared: tests only read it)."""
    cache = kv_procs.make_cache(dtype, kv_procs.SRC_BLOCKS)
    kv_procs.fill(cache, seed)
    return cache


def frame(
    src: PagedKVCache, ticket: pb.TransferTicket, src_ids: list[int], layer: int
) -> tuple[pb.KVFrameHeader, list[torch.Tensor]]:
    dst = list(ticket.dst_block_ids)
    h = make_header(ticket.request_id, ticket.transfer_id, src.spec, layer, layer + 1, src_ids, dst)
    return h, frame_regions(src, layer, layer + 1, block_runs(src_ids, dst), "src")


def land(rx: KVReceiver, header: pb.KVFrameHeader, regions: list[torch.Tensor]) -> None:
    """What a transport does with a frame: check, copy region by region, end."""
    res, dst = rx.begin_frame(header)
    for s, d in zip(regions, dst, strict=True):
        d.copy_(s)
    rx.end_frame(res, header)


def expected_pages(dtype: str, src_ids: list[int], seed: int = SRC_SEED) -> torch.Tensor:
    return kv_procs.source_pages(dtype, seed, src_ids)


# ---- the local transport, bit for bit ------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_transport_bit_exact(dtype: str) -> None:
    rx = Rx(dtype)
    endpoint = get_transport("local").listen(rx.receiver)
    rx.receiver.address = endpoint.address
    sender = KVSender(src_cache(dtype), "p", get_transport("local"))
    try:
        ticket = rx.receiver.reserve("r", 16 * 5 + 7)
        dst = list(ticket.dst_block_ids)
        # Non-contiguous (the pool is fragmented); ascending, as the block manager hands out
        # fresh blocks. The source ids are out of order, so the mapping is still exercised.
        assert dst == sorted(dst) and dst != list(range(dst[0], dst[0] + len(dst)))
        src_ids = kv_procs.spread_ids(len(dst))
        before = rx.snapshot()
        ack = sender.send(ticket, src_ids)
        assert ack.status == pb.TRANSFER_STATUS_COMPLETE
        assert ack.bytes_received == L * len(dst) * rx.cache.spec.page_bytes
        assert kv_procs.same_bytes(rx.cache.data[:, :, dst], expected_pages(dtype, src_ids))
        assert rx.changed_blocks(before) <= set(dst)
        res = rx.receiver.take(ticket.transfer_id)
        rx.blocks.free(res.request_id)
        rx.assert_released()
    finally:
        sender.close()
        endpoint.close()


def test_close_ends_the_lane_threads_after_their_queued_pushes() -> None:
    """A layer-by-layer transfer (`push_async`) runs on its receiver's lane thread; `close`
    ends that thread, after what was queued, so that nothing keeps the sender (its cache,
    its last transfer) alive: a prefill worker shut down in-process otherwise left its
    whole engine in memory."""
    rx = Rx("float32")
    endpoint = get_transport("local").listen(rx.receiver)
    rx.receiver.address = endpoint.address
    sender = KVSender(src_cache(), "p", get_transport("local"))
    try:
        ticket = rx.receiver.reserve("r", 16 * 3)
        out = sender.start(ticket, kv_procs.spread_ids(len(ticket.dst_block_ids)))
        for layer in range(L):
            sender.push_async(out, layer + 1)
        pusher = out.lane._thread
        assert pusher.is_alive()
        assert sender.finish(out).status == pb.TRANSFER_STATUS_COMPLETE
        assert out.layers_sent == L and sender.num_channels == 1
        sender.close()
        assert not pusher.is_alive() and sender.num_channels == 0
        rx.blocks.free(rx.receiver.take(ticket.transfer_id).request_id)
        rx.assert_released()
        ref = weakref.ref(sender)
        del sender, out
        gc.collect()
        assert ref() is None, "something still holds the closed sender"
    finally:
        endpoint.close()


class HungConnect:
    """The local transport, except that a connect to `hung` waits until `release` (or 30 s)
    and then fails: a receiver that died mid-handshake, whose store client retries until
    its timeout."""

    name = "local"

    def __init__(self, hung: str) -> None:
        self.real = get_transport("local")
        self.hung = hung
        self.entered = threading.Event()
        self.release = threading.Event()

    def connect(self, address: str, sender_id: str) -> Any:
        if address != self.hung:
            return self.real.connect(address, sender_id)
        self.entered.set()
        self.release.wait(30.0)
        raise TransferError(f"cannot open a pair with {address}: connection reset")


def test_a_receiver_that_hangs_its_connect_holds_up_its_own_transfers_only() -> None:
    """The chaos kill of a decode worker mid-handshake: c10d's store client retried its
    connect for 10 s on the engine thread, under a lock every connect took, so the prefill
    worker ran no prompt pass and sent no KV to anyone for 10 s (an n = 4 request ended
    10.5 s after the kill). Now the engine thread's calls (`start`, `push_async`, `abort`)
    return while the connect hangs, and another receiver's transfer completes meanwhile."""
    good, dead = Rx("float32"), Rx("float32")
    endpoint = get_transport("local").listen(good.receiver)
    good.receiver.address = endpoint.address
    dead.receiver.address = "127.0.0.1:9"  # the ticket's address; its connect hangs
    transport = HungConnect(dead.receiver.address)
    sender = KVSender(src_cache(), "p", transport)  # type: ignore[arg-type]
    try:
        stuck = dead.receiver.reserve("stuck", 16 * 3)
        out = sender.start(stuck, kv_procs.spread_ids(len(stuck.dst_block_ids)))
        for layer in range(L):
            sender.push_async(out, layer + 1)
        assert transport.entered.wait(30.0), "the lane never tried to connect"
        sender.abort(out, "its decode worker was found silent")  # returns: queued on the lane
        ticket = good.receiver.reserve("bystander", 16 * 3)
        ack = sender.send(ticket, kv_procs.spread_ids(len(ticket.dst_block_ids)))
        assert ack.status == pb.TRANSFER_STATUS_COMPLETE
        assert not transport.release.is_set() and out.error is None, "the hung connect ended"
        good.blocks.free(good.receiver.take(ticket.transfer_id).request_id)
        good.assert_released()
        transport.release.set()
        with pytest.raises(TransferError, match="connection reset"):
            sender.finish(out, timeout_s=30.0)
    finally:
        transport.release.set()
        sender.close()
        endpoint.close()


# ---- an engine continues from transferred KV -----------------------------------------------
PROMPTS = [[5, 9, 200, 17, 33], list(range(40, 56)), [(7 * i + 3) % 500 + 4 for i in range(37)]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdserve.checkpoint import write_checkpoint

    return str(write_checkpoint("tiny", tmp_path_factory.mktemp("kv-tiny")))


def test_engine_local_transfer_matches_colocated(tiny_checkpoint: str) -> None:
    cfg = kv_procs.engine_config(tiny_checkpoint)
    colocated = LLMEngine.from_config(cfg)
    prefill = LLMEngine.from_config(cfg)
    decode = LLMEngine.from_config(cfg)
    kv_procs.fragment(prefill.blocks, seed=1)
    kv_procs.fragment(decode.blocks, seed=2)
    base = (prefill.blocks.num_free_blocks, decode.blocks.num_free_blocks)
    tr = get_transport("local")
    receiver = KVReceiver(decode.cache, decode.blocks, transport="local")
    endpoint = tr.listen(receiver)
    receiver.address = endpoint.address
    sender = KVSender(prefill.cache, "prefill-0", tr)
    try:
        for i, prompt in enumerate(PROMPTS):
            want = colocated.generate([prompt], kv_procs.greedy(MAX_TOKENS))[0].output_token_ids
            rid = f"r{i}"
            req = decode.make_request(rid, prompt, kv_procs.greedy(MAX_TOKENS))
            ticket = receiver.reserve(rid, len(prompt))
            first, src = kv_procs.prefill_and_send(prefill, sender, ticket, prompt, MAX_TOKENS)
            assert len(src) == len(ticket.dst_block_ids)
            got = kv_procs.decode_after_transfer(
                decode, receiver, req, ticket.transfer_id, first, 5.0
            )
            assert got == list(want), (prompt, got, want)
            assert (prefill.blocks.num_free_blocks, decode.blocks.num_free_blocks) == base
    finally:
        sender.close()
        endpoint.close()


def test_workers_shut_down_in_process_leave_no_engine_or_thread(tiny_checkpoint: str) -> None:
    """`run_with_workers` (the census tool, these tests) shuts its workers down in this
    process: afterwards no engine may stay reachable and no KV thread run. A sender's pusher
    and a receiver's lease reaper each held their worker's engine, and its memory, after
    shutdown (one forever, one for up to its interval)."""
    import threading

    from pdserve.client import make_request
    from pdserve.config import ServeConfig
    from pdserve.launch import run_with_workers
    from tests.in_process import generate

    cfg = ServeConfig.load(
        None, {"model": {"model": tiny_checkpoint}, "transfer": {"transport": "local"}}
    )
    seen: list[weakref.ref[LLMEngine]] = []

    async def body(router: Any, prefill: Any, decode: Any) -> None:
        seen.extend(weakref.ref(w.engine) for w in (prefill, decode))
        toks, act = await generate(router, make_request(PROMPTS[2], max_tokens=4))
        assert len(toks) == 4 and act.kv_transfer_bytes > 0  # the KV went through a sender

    run_with_workers(cfg, Path(tiny_checkpoint), body)
    gc.collect()
    assert [r() for r in seen] == [None, None]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


# ---- headers that must be refused before a byte lands --------------------------------------
def _layout(field: str, value: Any) -> Any:
    def mutate(h: pb.KVFrameHeader) -> None:
        setattr(h.layout, field, value)

    return mutate


def _set(field: str, value: Any) -> Any:
    def mutate(h: pb.KVFrameHeader) -> None:
        if isinstance(value, list):
            del getattr(h, field)[:]
            getattr(h, field).extend(value)
        else:
            setattr(h, field, value)

    return mutate


def _dst(f: Any) -> Any:
    def mutate(h: pb.KVFrameHeader) -> None:
        ids = f(list(h.dst_block_ids))
        del h.dst_block_ids[:]
        h.dst_block_ids.extend(ids)

    return mutate


PINNED = 3  # fragment() pins every fourth block: 3, 7, 11, 15
BAD_HEADERS: dict[str, tuple[Any, str]] = {
    "fingerprint": (_layout("model_fingerprint", "other-model"), "model_fingerprint"),
    "dtype": (_layout("dtype", pb.KV_DTYPE_BFLOAT16), "dtype"),
    "dtype_unknown": (_layout("dtype", 17), "dtype"),
    "num_layers": (_layout("num_layers", L + 1), "num_layers"),
    "block_size": (_layout("block_size", 8), "block_size"),
    "num_kv_heads": (_layout("num_kv_heads", 1), "num_kv_heads"),
    "head_dim": (_layout("head_dim", 8), "head_dim"),
    "payload_short": (lambda h: setattr(h, "payload_bytes", h.payload_bytes - 1), "payload"),
    "payload_long": (lambda h: setattr(h, "payload_bytes", h.payload_bytes + 4), "payload"),
    "unreserved": (_dst(lambda d: [*d[:-1], PINNED]), "not reserved"),
    "free_block": (_dst(lambda d: [*d[:-1], RX_BLOCKS - 2]), "not reserved"),
    "duplicate": (_dst(lambda d: [d[0], *d[:-1]]), "repeat"),
    "layer_past_end": (_set("layer_end", L + 1), "layer range"),
    "layer_empty": (_set("layer_start", 1), "layer range"),
    "no_blocks": (_dst(lambda d: []), "non-empty"),
    "length_mismatch": (_set("src_block_ids", [1, 2]), "equal length"),
    "src_out_of_range": (_set("src_block_ids", [1 << 31, 2, 3, 4]), "src block id"),
}


@pytest.mark.parametrize("kind", list(BAD_HEADERS))
def test_begin_frame_rejects_bad_header(kind: str) -> None:
    rx = Rx()
    src = src_cache()
    ticket = rx.receiver.reserve("r", 16 * 3 + 5)  # 4 blocks
    assert len(ticket.dst_block_ids) == 4 and PINNED not in ticket.dst_block_ids
    assert RX_BLOCKS - 2 not in ticket.dst_block_ids  # still free
    h, _ = frame(src, ticket, kv_procs.spread_ids(4), 0)
    mutate, words = BAD_HEADERS[kind]
    mutate(h)
    before = rx.snapshot()
    with pytest.raises(TransferRejected, match=words):
        rx.receiver.begin_frame(h)
    assert rx.changed_blocks(before) == set()
    # A bad frame breaks its transfer: the reservation is released at once.
    rx.assert_released()
    with pytest.raises(TransferError):
        rx.receiver.wait(ticket.transfer_id, 0.1)


def test_begin_frame_rejects_wrong_request_and_repeats() -> None:
    rx = Rx()
    src = src_cache()
    src_ids = kv_procs.spread_ids(4)
    ticket = rx.receiver.reserve("r", 16 * 3 + 5)
    h, regions = frame(src, ticket, src_ids, 0)
    h.request_id = "someone-else"
    with pytest.raises(TransferRejected, match="request id"):
        rx.receiver.begin_frame(h)
    # Not this transfer's sender speaking: the reservation stands.
    assert rx.receiver.get(ticket.transfer_id) is not None
    h, regions = frame(src, ticket, src_ids, 0)
    land(rx.receiver, h, regions)
    before = rx.snapshot()
    with pytest.raises(TransferRejected, match="already received"):
        rx.receiver.begin_frame(h)
    assert rx.changed_blocks(before) == set()
    rx.assert_released()


def test_expired_lease_rejects_frames() -> None:
    rx = Rx(lease_s=0.05)
    ticket = rx.receiver.reserve("r", 20)
    time.sleep(0.1)
    h, _ = frame(src_cache(), ticket, [1, 2], 0)
    with pytest.raises(TransferRejected, match="lease expired"):
        rx.receiver.begin_frame(h)
    rx.assert_released()


@pytest.mark.parametrize("kind", kv_procs.BAD_LAYOUTS)
def test_local_sender_finish_raises_rejected(kind: str) -> None:
    """A misconfigured prefill worker, through a transport: finish() raises TransferRejected
    naming the field; not a byte of the destination changed."""
    rx = Rx()
    tr = get_transport("local")
    endpoint = tr.listen(rx.receiver)
    rx.receiver.address = endpoint.address
    bad = kv_procs.bad_cache("float32", kind)
    sender = KVSender(bad, "bad", tr)
    try:
        ticket = rx.receiver.reserve("r", 16 * 3 + 5)
        src_ids = kv_procs.spread_ids(4)
        # Its own check refuses a ticket whose layout differs, before anything is sent...
        with pytest.raises(TransferRejected, match=kv_procs.BAD_LAYOUTS[kind]):
            sender.start(ticket, src_ids)
        assert rx.receiver.get(ticket.transfer_id) is not None
        # ...and the receiver refuses its frames if the ticket was doctored to match.
        ticket.layout.CopyFrom(layout_to_pb(bad.spec))
        before = rx.snapshot()
        with pytest.raises(TransferRejected, match=kv_procs.BAD_LAYOUTS[kind]):
            sender.send(ticket, src_ids)
        assert rx.changed_blocks(before) == set()
        rx.assert_released()
    finally:
        endpoint.close()


# ---- frames in flight, late frames -----------------------------------------------------------
def test_blocks_not_freed_under_a_writer() -> None:
    rx = Rx()
    ticket = rx.receiver.reserve("r", 40)
    h, regions = frame(src_cache(), ticket, [1, 2, 3], 0)
    res, dst = rx.receiver.begin_frame(h)
    assert rx.receiver.fail(ticket.transfer_id, "client went away")
    # FAILED at once (waiters wake up), but the blocks stay allocated while the frame writes.
    assert res.state is ReservationState.FAILED and res.done.is_set()
    assert rx.blocks.num_free_blocks < rx.base_free
    for s, d in zip(regions, dst, strict=True):
        d.copy_(s)
    rx.receiver.end_frame(res, h)
    rx.assert_released()


def _reuse_pool() -> tuple[Rx, PagedKVCache]:
    """8 blocks, 2 pinned: a 6-block reservation takes every free block."""
    return Rx(num_blocks=8), src_cache()


@pytest.mark.parametrize("how", ["receiver_fail", "sender_abort"])
def test_late_frames_never_reach_the_new_owner(how: str) -> None:
    rx, src = _reuse_pool()
    tr = get_transport("local")
    endpoint = tr.listen(rx.receiver)
    rx.receiver.address = endpoint.address
    sender = KVSender(src, "p", tr)
    src_ids = kv_procs.spread_ids(6)
    try:
        old = rx.receiver.reserve("old", 16 * 5 + 3)
        out = sender.start(old, src_ids)
        sender.push(out, 1)  # layer 0 landed
        if how == "receiver_fail":
            rx.receiver.fail(old.transfer_id, "cancelled")
        else:
            sender.abort(out, "client went away")
            assert sender.flush(out), "the abort did not run on its lane"
        assert rx.receiver.get(old.transfer_id) is None
        new = rx.receiver.reserve("new", 16 * 5 + 3)
        assert sorted(new.dst_block_ids) == sorted(old.dst_block_ids)
        before = rx.snapshot()
        # Straight into the receiver: a frame of the old transfer id...
        h, _ = frame(src, old, src_ids, 1)
        with pytest.raises(TransferRejected, match="unknown, finished or aborted"):
            rx.receiver.begin_frame(h)
        # ...and through the transport: the sender's remaining layers.
        with pytest.raises(TransferRejected, match="unknown, finished or aborted"):
            sender.finish(out)
        assert rx.changed_blocks(before) == set()
        # The late frames did not fail the new owner's reservation either.
        res = rx.receiver.get(new.transfer_id)
        assert res is not None and res.state is ReservationState.RESERVED
        assert sender.send(new, src_ids).status == pb.TRANSFER_STATUS_COMPLETE
        dst = list(new.dst_block_ids)
        assert kv_procs.same_bytes(rx.cache.data[:, :, dst], expected_pages("float32", src_ids))
        rx.blocks.free(rx.receiver.take(new.transfer_id).request_id)
        rx.assert_released()
    finally:
        sender.close()
        endpoint.close()


# ---- leases ----------------------------------------------------------------------------------
def test_reservation_lease_expires() -> None:
    rx = Rx()
    ticket = rx.receiver.reserve("r", 40, lease_s=0.2)
    assert rx.receiver.expire() == []
    assert rx.blocks.num_free_blocks < rx.base_free
    time.sleep(0.25)
    assert rx.receiver.expire() == [ticket.transfer_id]
    rx.assert_released()
    assert rx.receiver.ack(ticket.transfer_id).status == pb.TRANSFER_STATUS_ABORTED


def test_reaper_frees_expired_reservations() -> None:
    rx = Rx()
    rx.receiver.start_reaper(interval_s=0.05)
    try:
        long = rx.receiver.reserve("long", 20)  # default lease: stays
        short = rx.receiver.reserve("short", 40, lease_s=0.2)
        res = rx.receiver.get(short.transfer_id)
        assert res is not None
        with pytest.raises(TransferError, match="lease expired"):
            rx.receiver.wait(short.transfer_id, 5.0)
        deadline = time.monotonic() + 2.0
        while rx.receiver.pending() > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rx.receiver.pending() == 1 and rx.receiver.get(long.transfer_id) is not None
        rx.receiver.fail(long.transfer_id, "done")
        rx.assert_released()
    finally:
        rx.receiver.close()


def test_sender_leases_release_on_ack_and_on_expiry() -> None:
    blocks = BlockManager(16, BS)
    leases = SenderLeases(lease_s=30.0)
    released: list[str] = []

    def hold(rid: str, lease_s: float | None = None) -> None:
        blocks.allocate(rid, [], 40)

        def release() -> None:
            released.append(rid)
            blocks.free(rid)

        leases.hold(rid, release, lease_s)

    hold("acked")
    hold("expiring", lease_s=0.1)
    assert len(leases) == 2 and blocks.num_free_blocks == 16 - 6
    assert leases.release("acked") and not leases.release("acked")  # exactly once
    assert released == ["acked"]
    assert leases.expire() == []
    time.sleep(0.15)
    assert leases.expire() == ["expiring"]
    assert not leases.release("expiring")  # an ack after expiry releases nothing twice
    assert released == ["acked", "expiring"] and len(leases) == 0
    assert blocks.num_free_blocks == 16
    blocks.check_integrity()


# ---- fuzzing: headers ------------------------------------------------------------------------
U32 = st.integers(0, 2**32 - 1)
SMALL = st.integers(0, L + 2)


# Values per header field: plausible ones (often valid) and arbitrary ones.
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "request_id": st.sampled_from(["", "x", "r", "r\x00"]),
    "transfer_id": st.text(max_size=4),
    "model_fingerprint": st.sampled_from(["", kv_procs.FINGERPRINT, kv_procs.FINGERPRINT + "x"]),
    "dtype": st.integers(0, 6),
    "num_layers": st.one_of(SMALL, U32),
    "block_size": st.sampled_from([0, 1, 8, BS, 32, 2**32 - 1]),
    "num_kv_heads": st.one_of(SMALL, U32),
    "head_dim": st.sampled_from([0, 8, 16, 32, 2**31]),
    "layer_start": st.one_of(SMALL, U32),
    "layer_end": st.one_of(SMALL, U32),
    "src_block_ids": st.lists(st.one_of(st.integers(0, 70), U32), max_size=6),
    # < 4: the i-th reserved block; otherwise block id (v - 4): pinned, free or out of range
    "dst_block_ids": st.lists(
        st.one_of(st.integers(0, 3), st.integers(0, RX_BLOCKS + 5), U32), max_size=6
    ),
    # small: off by that much from the consistent size; large: as is
    "payload_bytes": st.one_of(st.integers(-3, 3), st.integers(0, 2**64 - 1)),
    "abort": st.booleans(),
}
LAYOUT_FIELDS = (
    "model_fingerprint",
    "dtype",
    "num_layers",
    "block_size",
    "num_kv_heads",
    "head_dim",
)
HEADER_PLAN = st.fixed_dictionaries(
    {
        "mutations": st.lists(
            st.sampled_from(sorted(FIELD_VALUES)).flatmap(
                lambda f: st.tuples(st.just(f), FIELD_VALUES[f])
            ),
            max_size=3,
        ),
        "landed_first": st.booleans(),
    }
)


def _valid(
    h: pb.KVFrameHeader, rx: Rx, ticket: pb.TransferTicket, landed: set[tuple[int, int]]
) -> bool:
    """An independent statement of which headers the receiver may accept."""
    spec = rx.cache.spec
    lay = h.layout
    dst = list(h.dst_block_ids)
    reserved = list(ticket.dst_block_ids)
    return (
        h.request_id == "r"
        and h.transfer_id == ticket.transfer_id
        and lay.wire_version == WIRE_VERSION
        and lay.model_fingerprint == spec.model_fingerprint
        and lay.dtype == pb.KV_DTYPE_FLOAT32
        and (lay.num_layers, lay.block_size) == (spec.num_layers, spec.block_size)
        and (lay.num_kv_heads, lay.head_dim) == (spec.num_kv_heads, spec.head_dim)
        and 0 <= h.layer_start < h.layer_end <= spec.num_layers
        and 0 < len(dst) == len(h.src_block_ids)
        and len(set(dst)) == len(dst)
        and set(dst) <= set(reserved)
        and all(s < 2**31 for s in h.src_block_ids)
        and not {(x, b) for x in range(h.layer_start, h.layer_end) for b in dst} & landed
        and h.payload_bytes == (h.layer_end - h.layer_start) * len(dst) * spec.page_bytes
    )


def _feed(rx: Rx, ticket: pb.TransferTicket, h: pb.KVFrameHeader, landed: set) -> None:
    """begin_frame must accept exactly the valid headers, raise nothing but TransferRejected,
    and never expose a byte outside the reservation."""
    valid = _valid(h, rx, ticket, landed)
    before = rx.snapshot()
    try:
        res, regions = rx.receiver.begin_frame(h)
    except TransferRejected:
        event("rejected")
        assert not valid, h
        assert rx.changed_blocks(before) == set()
        rx.blocks.check_integrity()
        if h.request_id == "r" and h.transfer_id == ticket.transfer_id:
            rx.assert_released()
        return
    event("accepted")
    assert valid, h
    for r in regions:
        assert r.is_contiguous()
        r.view(torch.uint8).fill_(0xA5)
    rx.receiver.end_frame(res, h)
    assert rx.changed_blocks(before) <= set(h.dst_block_ids)
    rx.blocks.check_integrity()


def _fresh(landed_first: bool) -> tuple[Rx, pb.TransferTicket, set[tuple[int, int]]]:
    rx = Rx()
    ticket = rx.receiver.reserve("r", 16 * 3 + 5)
    landed: set[tuple[int, int]] = set()
    if landed_first:  # layer 1 of the first two blocks already landed
        src_ids = [5, 9]
        dst = list(ticket.dst_block_ids)[:2]
        h = make_header("r", ticket.transfer_id, rx.cache.spec, 1, 2, src_ids, dst)
        land(rx.receiver, h, frame_regions(src_cache(), 1, 2, block_runs(src_ids, dst), "src"))
        landed = {(1, b) for b in dst}
    return rx, ticket, landed


FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(plan=HEADER_PLAN)
def test_fuzzed_headers_are_rejected_cleanly(plan: dict[str, Any]) -> None:
    rx, ticket, landed = _fresh(plan["landed_first"])
    reserved = list(ticket.dst_block_ids)
    h = make_header("r", ticket.transfer_id, rx.cache.spec, 0, 1, [1, 2, 7, 8], reserved)
    mutations = dict(plan["mutations"])
    payload = mutations.pop("payload_bytes", 0)
    for name, value in mutations.items():
        if name in LAYOUT_FIELDS:
            setattr(h.layout, name, value)
        elif name == "dst_block_ids":
            del h.dst_block_ids[:]
            h.dst_block_ids.extend(reserved[v] if v < 4 else v - 4 for v in value)
        elif name == "src_block_ids":
            del h.src_block_ids[:]
            h.src_block_ids.extend(value)
        else:
            setattr(h, name, value)
    consistent = max(h.layer_end - h.layer_start, 0) * len(h.dst_block_ids)
    consistent *= rx.cache.spec.page_bytes
    h.payload_bytes = max(0, consistent + payload if -3 <= payload <= 3 else payload)
    _feed(rx, ticket, h, landed)


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=160),
        st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
    ),
    landed_first=st.booleans(),
)
@example(data=[(149, 0)], landed_first=False)  # zeroes the layout's wire_version: refused
def test_random_bytes_as_headers(data: bytes | list[tuple[int, int]], landed_first: bool) -> None:
    """Random bytes, or a valid header's bytes with a few bytes overwritten."""
    rx, ticket, landed = _fresh(landed_first)
    if isinstance(data, list):
        valid = make_header(
            "r", ticket.transfer_id, rx.cache.spec, 0, 1, [1, 2, 7, 8], ticket.dst_block_ids
        )
        buf = bytearray(valid.SerializeToString())
        for pos, byte in data:
            buf[pos % len(buf)] = byte
        data = bytes(buf)
    try:
        h = pb.KVFrameHeader.FromString(data)
    except Exception:  # not a parseable header: nothing to feed
        return
    _feed(rx, ticket, h, landed)


# ---- fuzzing: broken gRPC streams ------------------------------------------------------------
def _stream(rx: Rx) -> tuple[pb.TransferTicket, list[int], list[pb.KVChunk]]:
    ticket = rx.receiver.reserve("r", 16 * 3 + 5)
    src = src_cache()
    src_ids = [1, 2, 7, 5]
    chunks = []
    for layer in range(L):
        h, regions = frame(src, ticket, src_ids, layer)
        chunks += [pb.KVChunk.FromString(raw) for raw in frame_chunks(h, regions)]
    return ticket, src_ids, chunks


@pytest.mark.parametrize("decode", ["generated", "fast"])
def test_intact_stream_completes(decode: str) -> None:
    """The frames' chunks land bit-exact whether the receiver decodes them with the
    generated class or with `decode_chunk` (zero-copy data views), as the servicer does."""
    rx = Rx()
    ticket, src_ids, chunks = _stream(rx)
    if decode == "fast":
        fast = [decode_chunk(c.SerializeToString()) for c in chunks]
        assert sum(isinstance(c, memoryview) for c in fast) == sum(
            c.HasField("data") for c in chunks
        )
        ack = consume_stream(rx.receiver, iter(fast))
    else:
        ack = consume_stream(rx.receiver, iter(chunks))
    assert ack.status == pb.TRANSFER_STATUS_COMPLETE, ack
    dst = list(ticket.dst_block_ids)
    assert kv_procs.same_bytes(rx.cache.data[:, :, dst], expected_pages("float32", src_ids))


@given(payload=st.binary(max_size=300), big=st.sampled_from([0, 127, 128, 16383, 16384, 1 << 20]))
def test_hand_encoded_data_chunks_are_kvchunks(payload: bytes, big: int) -> None:
    """`encode_data_chunk` writes exactly the generated class's bytes (the wire contract),
    and `decode_chunk` reads them back as the same payload; anything else falls back."""
    for data in (payload, bytes(big)):
        raw = encode_data_chunk(memoryview(data))
        assert raw == pb.KVChunk(data=data).SerializeToString()
        got = decode_chunk(raw)
        assert isinstance(got, memoryview) and bytes(got) == data
    header = pb.KVChunk(header=pb.KVFrameHeader(request_id="r", payload_bytes=3))
    got_h = decode_chunk(header.SerializeToString())
    assert isinstance(got_h, pb.KVChunk) and got_h.header.request_id == "r"
    two = pb.KVChunk(data=payload).SerializeToString() + pb.KVChunk(data=b"x").SerializeToString()
    got_2 = decode_chunk(two)  # a repeated field: the generated class decides (last wins)
    assert isinstance(got_2, pb.KVChunk) and got_2.data == b"x"


def _broken(chunks: list[pb.KVChunk]) -> Iterator[pb.KVChunk]:
    yield from chunks
    raise RuntimeError("peer went away")


MUTATION = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 0.999)),
    st.tuples(st.just("cut_inside"), st.floats(0, 0.999), st.floats(0, 0.999)),
    st.tuples(st.just("drop"), st.floats(0, 0.999)),
    st.tuples(st.just("duplicate"), st.floats(0, 0.999)),
    st.tuples(st.just("junk"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("break"), st.floats(0, 1)),
)


@FUZZ
@given(mutation=MUTATION)
def test_broken_streams_fail_cleanly(mutation: tuple[Any, ...]) -> None:
    rx = Rx()
    ticket, _, chunks = _stream(rx)
    before = rx.snapshot()
    kind, at = mutation[0], mutation[1]
    n = len(chunks)
    i = min(int(at * n), n - 1)
    stream: Any
    if kind == "cut":
        stream = iter(chunks[:i])
    elif kind == "cut_inside":
        data = [j for j, c in enumerate(chunks) if c.HasField("data")]
        j = data[min(int(at * len(data)), len(data) - 1)]
        cut = chunks[j].data[: int(mutation[2] * len(chunks[j].data))]
        stream = iter([*chunks[:j], pb.KVChunk(data=cut)])
    elif kind == "drop":
        stream = iter(chunks[:i] + chunks[i + 1 :])
    elif kind == "duplicate":
        stream = iter(chunks[: i + 1] + chunks[i:])
    elif kind == "junk":
        k = min(int(at * (n + 1)), n)
        stream = iter([*chunks[:k], pb.KVChunk(data=mutation[2]), *chunks[k:]])
    else:
        stream = _broken(chunks[: min(int(at * (n + 1)), n)])
    ack = consume_stream(rx.receiver, stream)  # must not raise
    assert ack.status != pb.TRANSFER_STATUS_COMPLETE, (kind, ack)
    # Whatever landed stayed inside the reservation...
    changed = rx.changed_blocks(before)
    assert changed <= set(ticket.dst_block_ids)
    res = rx.receiver.get(ticket.transfer_id)
    if res is None:  # ...and the stream's transfer was released,
        rx.assert_released()
    else:  # unless the stream broke before naming it: then nothing of it landed either
        assert res.state is ReservationState.RESERVED and not res.received and not changed
        rx.blocks.check_integrity()


# ---- the shared secret: channels that cannot prove it land nothing -----------------------
SECRET = "test-kv-secret-0123456789abcdef"
WRONG_SECRET = "another-secret-0123456789abcdef"
AUTH_TIMEOUT_S = 5.0
AUTH_TRANSPORTS = ("torch_dist", "grpc", "local")


def _num_refused(endpoint: Endpoint) -> int | None:
    """The endpoint's count of refused channels, where the transport keeps one."""
    if isinstance(endpoint, TorchDistEndpoint):
        return endpoint.refused_pairs
    if isinstance(endpoint, GrpcEndpoint):
        return endpoint.servicer.num_refused
    return None


def _sender(
    transport: str, name: str, secret: str | None, timeout_s: float = AUTH_TIMEOUT_S
) -> KVSender:
    return KVSender(src_cache(), name, get_transport(transport, timeout_s, secret=secret))


@pytest.mark.parametrize("transport", AUTH_TRANSPORTS)
def test_only_senders_with_the_shared_secret_land_frames(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No secret, then a wrong one: refused with TransferUnauthenticated before any byte
    lands, the reservation untouched; then a sender with the secret, on the same receiver and
    the same ticket, lands every page bit for bit."""
    rx = Rx()
    tr = get_transport(transport, AUTH_TIMEOUT_S, secret=SECRET)
    endpoint = tr.listen(rx.receiver)
    rx.receiver.address = endpoint.address
    ticket = rx.receiver.reserve("r", 16 * 3 + 5)
    dst = list(ticket.dst_block_ids)
    src_ids = kv_procs.spread_ids(len(dst))
    before = rx.snapshot()
    free_before = rx.blocks.num_free_blocks
    senders = []
    try:
        for i, secret in enumerate((None, WRONG_SECRET)):
            senders.append(intruder := _sender(transport, f"intruder-{i}", secret))
            with pytest.raises(TransferUnauthenticated, match="authentication failed"):
                intruder.send(ticket, src_ids)
            assert rx.changed_blocks(before) == set()
            res = rx.receiver.get(ticket.transfer_id)
            assert res is not None and res.state is ReservationState.RESERVED
            assert not res.received and res.bytes_received == 0
            assert rx.blocks.num_free_blocks == free_before
            rx.blocks.check_integrity()
        assert _num_refused(endpoint) in (2, None)
        senders.append(sender := _sender(transport, "p", SECRET))
        ack = sender.send(ticket, src_ids)
        assert ack.status == pb.TRANSFER_STATUS_COMPLETE
        assert kv_procs.same_bytes(rx.cache.data[:, :, dst], expected_pages("float32", src_ids))
        assert rx.changed_blocks(before) <= set(dst)
        rx.blocks.free(rx.receiver.take(ticket.transfer_id).request_id)
        rx.assert_released()
        assert SECRET not in caplog.text and WRONG_SECRET not in caplog.text
    finally:
        for s in senders:
            s.close()
        endpoint.close()


@pytest.mark.parametrize("transport", AUTH_TRANSPORTS)
def test_a_sender_with_the_secret_refuses_an_open_receiver(transport: str) -> None:
    """Misconfiguration fails loudly: the receiver must prove the secret back. (The open
    torch_dist receiver then waits `timeout_s` for a group the sender never joins.)"""
    rx = Rx()
    endpoint = get_transport(transport, 1.0).listen(rx.receiver)
    rx.receiver.address = endpoint.address
    sender = _sender(transport, "p", SECRET, 1.0)
    try:
        ticket = rx.receiver.reserve("r", 16 * 2)
        with pytest.raises(TransferUnauthenticated, match=r"failed authentication|secret"):
            sender.send(ticket, kv_procs.spread_ids(len(ticket.dst_block_ids)))
        rx.receiver.fail(ticket.transfer_id, "test over")
        rx.assert_released()
    finally:
        sender.close()
        endpoint.close()


def test_torch_dist_refuses_forged_control_connections() -> None:
    """The control port is plaintext and anyone may connect: a connection claiming a pair
    with a hello it cannot seal (or a pair that already has its connection) is refused, and
    no frame it sends can land; the real pairs carry on."""
    import socket
    import struct

    rx = Rx()
    endpoint = get_transport("torch_dist", AUTH_TIMEOUT_S, secret=SECRET).listen(rx.receiver)
    assert isinstance(endpoint, TorchDistEndpoint)
    rx.receiver.address = endpoint.address
    victim = _sender("torch_dist", "p0", SECRET)
    sender = _sender("torch_dist", "p1", SECRET)
    try:
        ticket = rx.receiver.reserve("r", 16 * 2)
        src_ids = kv_procs.spread_ids(len(ticket.dst_block_ids))
        victim.channel(endpoint.address)  # pair 0, authenticated, no frame sent yet
        before = rx.snapshot()
        host, _ = endpoint.address.rsplit(":", 1)
        ctl_port = endpoint._listener.getsockname()[1]
        h, _ = frame(src_cache(), ticket, src_ids, 0)
        for claim in (b"0:", b"7:"):  # a pair that has its connection, and one that never will
            with socket.create_connection((host, ctl_port)) as s:
                for record in (
                    claim + bytes(auth.TAG_BYTES) + b"hello",
                    bytes(auth.TAG_BYTES) + h.SerializeToString(),
                ):
                    s.sendall(struct.pack("!I", len(record)) + record)
                s.settimeout(AUTH_TIMEOUT_S + 2)
                assert s.recv(1) == b""  # the endpoint hung up
        assert endpoint.refused_connections == 2
        assert 7 not in endpoint._pending  # no slot kept for a pair nobody authenticated
        assert endpoint.broken_pairs == 0
        assert rx.changed_blocks(before) == set()
        res = rx.receiver.get(ticket.transfer_id)
        assert res is not None and res.state is ReservationState.RESERVED
        assert sender.send(ticket, src_ids).status == pb.TRANSFER_STATUS_COMPLETE
        rx.blocks.free(rx.receiver.take(ticket.transfer_id).request_id)
        rx.assert_released()
    finally:
        victim.close()
        sender.close()
        endpoint.close()


def test_grpc_stream_carries_only_its_authenticated_transfer() -> None:
    rx = Rx()
    ticket, _, chunks = _stream(rx)
    other = rx.receiver.reserve("r2", 16)
    before = rx.snapshot()
    ack = consume_stream(rx.receiver, iter(chunks), other.transfer_id)
    assert ack.status == pb.TRANSFER_STATUS_REJECTED and "authenticated for" in ack.error
    assert rx.changed_blocks(before) == set()
    res = rx.receiver.get(ticket.transfer_id)
    assert res is not None and res.state is ReservationState.RESERVED and not res.received


@FUZZ
@given(
    body=st.binary(max_size=64),
    flips=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_tampered_or_forged_records_never_open(body: bytes, flips: list[tuple[int, int]]) -> None:
    seal = auth.RecordSeal(auth.mac(SECRET, "records"))
    record = seal.seal("ctl/0/frame/3", body)
    assert seal.open("ctl/0/frame/3", record) == body
    assert seal.open("ctl/0/frame/4", record) is None  # bound to where it is stored
    assert auth.RecordSeal(auth.mac(WRONG_SECRET, "records")).open("ctl/0/frame/3", record) is None
    buf = bytearray(record)
    for pos, x in flips:
        buf[pos % len(buf)] ^= x
    assert seal.open("ctl/0/frame/3", bytes(buf)) is None or bytes(buf) == record
    assert seal.open("ctl/0/frame/3", bytes(auth.TAG_BYTES) + body) is None


def test_shared_secret_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert TransferConfig().resolve_secret() is None
    cfg = TransferConfig(shared_secret=SECRET)
    assert cfg.resolve_secret() == SECRET and SECRET not in repr(cfg)
    monkeypatch.setenv(auth.SECRET_ENV, WRONG_SECRET)
    assert cfg.resolve_secret() == SECRET  # the config's own wins
    assert TransferConfig().resolve_secret() == WRONG_SECRET
    monkeypatch.setenv(auth.SECRET_ENV, "")  # set but empty must not mean "no auth"
    with pytest.raises(ValueError, match="at least"):
        TransferConfig().resolve_secret()
    with pytest.raises(ValueError, match="at least"):
        TransferConfig(shared_secret="short")


# ---- packaging ---------------------------------------------------------------------------------
BLOCK_IMPORTS = """
import sys
for name in ("ray", "redis", "grpc"):
    sys.modules[name] = None  # any import of them raises ImportError
import kv_transfer.receiver
import kv_transfer.sender
import kv_transfer.transports.local
import kv_transfer.transports.torch_dist
from kv_transfer.transports.base import get_transport
get_transport("local")
get_transport("torch_dist")
print("ok")
"""


def test_transports_import_without_ray_redis_or_grpc() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_IMPORTS], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_generated_protos_match_committed(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    env = {**os.environ, "PY": sys.executable}
    subprocess.run(["bash", "protos/gen.sh", str(tmp_path)], cwd=REPO, env=env, check=True)
    committed = sorted((REPO / "protos/pdserve/v1").glob("*_pb2*.py*"))
    assert committed
    generated = sorted((tmp_path / "protos/pdserve/v1").glob("*_pb2*.py*"))
    assert [p.name for p in generated] == [p.name for p in committed]
    for ours, theirs in zip(committed, generated, strict=True):
        assert filecmp.cmp(ours, theirs, shallow=False), f"{ours.name} differs from gen.sh output"


# ---- CUDA caches -----------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_caches_local_and_grpc_writer(dtype: str) -> None:
    src = kv_procs.make_cache(dtype, kv_procs.SRC_BLOCKS, device="cuda:0")
    kv_procs.fill(src, SRC_SEED)
    for path in ("local", "grpc_writer"):
        dst = kv_procs.make_cache(dtype, RX_BLOCKS, device="cuda:0")
        kv_procs.fill(dst, RX_SEED)
        blocks = BlockManager(RX_BLOCKS, BS)
        kv_procs.fragment(blocks)
        rx = KVReceiver(dst, blocks, transport="local")
        ep = get_transport("local").listen(rx)
        rx.address = ep.address
        ticket = rx.reserve("r", 16 * 3 + 5)
        src_ids = kv_procs.spread_ids(len(ticket.dst_block_ids))
        before = dst.data.clone()
        if path == "local":  # page copies device to device
            ack = KVSender(src, "p", get_transport("local")).send(ticket, src_ids)
        else:  # the gRPC receiver's device path: chunks copied into CUDA pages
            frames = [frame(src, ticket, src_ids, layer) for layer in range(L)]
            ack = consume_stream(rx, (decode_chunk(c) for f in frames for c in frame_chunks(*f)))
        assert ack.status == pb.TRANSFER_STATUS_COMPLETE
        torch.cuda.synchronize()
        dst_ids = list(ticket.dst_block_ids)
        assert kv_procs.same_bytes(dst.data[:, :, dst_ids], expected_pages(dtype, src_ids))
        others = [b for b in range(RX_BLOCKS) if b not in dst_ids]
        assert kv_procs.same_bytes(dst.data[:, :, others], before[:, :, others])
        regions = frame_regions(dst, 0, L, block_runs(src_ids, dst_ids), "dst")
        assert all(r.is_cuda and r.is_contiguous() for r in regions)
        assert sum(r.numel() * r.element_size() for r in regions) == payload_bytes(
            dst.spec, L, len(dst_ids)
        )
        ep.close()
