"""KV transfer between real processes over loopback sockets (torch_dist/gloo and gRPC).

Every worker is a spawned process (tests/kv_procs.py) with its own caches, block managers,
receivers, senders and engines; tickets travel between them as serialized protobufs through
this test process, as a router would carry them. One set of workers serves the whole module:
two decode workers (D0, D1), two prefill workers (P0, P1) and four victims that get killed.

What is checked after every transfer (on the decode side, see kv_procs.rx_collect/rx_check):
the destination pages equal the sender's pages byte for byte, the block manager's integrity
holds, the pool is back to its starting size, and the *whole* cache equals its mirror, so no
byte landed anywhere but in a completed transfer's blocks.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_procs

from protos.pdserve.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.timeout(300)  # generous: the first test also starts every worker

TRANSPORTS = ("torch_dist", "grpc")
DTYPES = ("float32", "bfloat16")
TIMEOUT_S = 2.0  # the transports' timeout: a dead or stalled peer fails a transfer after this
COMPLETE = "TRANSFER_STATUS_COMPLETE"
CALL_TIMEOUT_S = 60.0


class WorkerError(RuntimeError):
    pass


class Worker:
    """A spawned kv_procs.serve process and its command pipe."""

    def __init__(self, name: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.seq = 0
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=kv_procs.serve, args=(child, name), name=name, daemon=True)
        self.proc.start()
        child.close()

    def submit(self, cmd: str, *args: Any, **kwargs: Any) -> None:
        self.seq += 1
        self.conn.send((self.seq, cmd, args, kwargs))

    def result(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The answer to the latest `submit` (answers to abandoned calls are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            while not self.conn.poll(0.02):
                if not self.proc.is_alive():
                    raise WorkerError(f"{self.name} died (exit code {self.proc.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no answer within {timeout} s")
            seq, status, value = self.conn.recv()
            if seq != self.seq:
                continue
            if status == "err":
                raise WorkerError(f"{self.name}:\n{value}")
            return value

    def call(self, cmd: str, *args: Any, timeout: float = CALL_TIMEOUT_S, **kwargs: Any) -> Any:
        self.submit(cmd, *args, **kwargs)
        return self.result(timeout)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye frame, sockets closed by the kernel."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def shutdown(workers: list[Worker], wait_s: float = 30.0) -> dict[str, int | None]:
    """Ask every worker to exit, give them `wait_s` together, then SIGKILL the rest.

    Returns each worker's exit code as it stood before any SIGKILL (None: did not exit).
    """
    for w in workers:
        if w.proc.is_alive():
            with contextlib.suppress(Exception):
                w.submit("exit")
    deadline = time.monotonic() + wait_s
    for w in workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
    codes = {w.name: w.proc.exitcode for w in workers}
    for w in workers:
        w.kill()
        w.conn.close()
    return codes


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdserve.checkpoint import write_checkpoint

    return str(write_checkpoint("tiny", tmp_path_factory.mktemp("kv-tiny")))


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint: str) -> Iterator[dict[str, Any]]:
    """D0, D1 (decode), P0, P1 (prefill) and victims V0..V4, all started at once.

    Tearing down checks that the survivors shut down cleanly: closing their endpoints and
    senders leaves nothing that aborts or hangs the interpreter on exit.
    """
    names = ["D0", "D1", "P0", "P1", "V0", "V1", "V2", "V3", "V4"]
    workers: dict[str, Worker] = {}
    try:
        for n in names:
            workers[n] = Worker(n)
        for w in workers.values():
            w.submit("ping")
        for w in workers.values():
            w.result(240)
        info: dict[tuple[str, str], Any] = {}
        # One receiving cache per (transport, dtype) on each decode worker, and one sending
        # cache per (transport, dtype) on each prefill worker, with distinct page patterns.
        for tr in TRANSPORTS:
            for dt in DTYPES:
                key = f"{tr}-{dt}"
                for d in ("D0", "D1"):
                    info[d, key] = workers[d].call("rx_open", key, tr, dt, timeout_s=TIMEOUT_S)
                for p in ("P0", "P1"):
                    workers[p].call("tx_open", key, tr, dt, seed_of(p, dt), timeout_s=TIMEOUT_S)
        yield {"w": workers, "info": info, "checkpoint": tiny_checkpoint}
    finally:
        codes = shutdown(list(workers.values()))
    survivors = {n: codes[n] for n in ("D0", "D1", "P0", "P1") if n in codes}
    assert all(c == 0 for c in survivors.values()), f"unclean worker exits: {survivors}"


def seed_of(prefill: str, dtype: str) -> int:
    return 1000 + 10 * int(prefill[1:]) + DTYPES.index(dtype)


def page_bytes(dtype: str) -> int:
    return kv_procs.make_cache(dtype, 1).spec.page_bytes


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // kv_procs.BLOCK_SIZE)


def is_contiguous(ids: list[int]) -> bool:
    return ids == list(range(ids[0], ids[0] + len(ids)))


def transfer(
    c: dict[str, Any],
    d: str,
    p: str,
    key: str,
    rid: str,
    num_tokens: int,
    offset: int = 0,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Reserve on `d`, send from `p`, collect on `d`: one whole transfer, checked."""
    w = c["w"]
    ticket = w[d].call("rx_reserve", key, rid, num_tokens)
    tid = pb.TransferTicket.FromString(ticket).transfer_id
    src = kv_procs.spread_ids(blocks_for(num_tokens), offset)
    assert w[p].call("tx_send", key, [(ticket, src)]) == [COMPLETE]
    got = w[d].call("rx_collect", key, tid, seed_of(p, dtype), src, 10.0)
    assert got["status"] == "complete" and got["exact"], got
    return got


def assert_clean(c: dict[str, Any], d: str, key: str) -> dict[str, Any]:
    """Nothing reserved, every block back, integrity, no stray byte anywhere in the cache."""
    chk = c["w"][d].call("rx_check", key)
    assert chk["pending"] == 0, chk
    assert chk["free"] == chk["base_free"], chk
    assert chk["untouched"], "bytes landed outside a completed transfer's blocks"
    return chk


# ---- bit-exact pages -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pages_arrive_bit_exact(cluster: dict[str, Any], transport: str, dtype: str) -> None:
    key = f"{transport}-{dtype}"
    dsts = []
    for i, n in enumerate((1, 16, 16 * 5 + 7, 16 * 9)):
        got = transfer(cluster, "D0", "P0", key, f"exact-{key}-{i}", n, offset=i, dtype=dtype)
        assert got["bytes"] == kv_procs.NUM_LAYERS * blocks_for(n) * page_bytes(dtype)
        dsts.append(got["dst"])
    # The receiver's pool is fragmented: destinations are not contiguous (ascending, as the
    # block manager hands out fresh blocks; the source ids are out of order).
    assert not is_contiguous(dsts[2]) and dsts[2] == sorted(dsts[2])
    assert_clean(cluster, "D0", key)


# ---- 2 prefill x 2 decode, 16 concurrent transfers ------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_by_two_concurrent(cluster: dict[str, Any], transport: str, dtype: str) -> None:
    w = cluster["w"]
    key = f"cc-{transport}-{dtype}"  # fresh caches: pair counts start at zero
    for d in ("D0", "D1"):
        w[d].call("rx_open", key, transport, dtype, timeout_s=TIMEOUT_S)
    for p in ("P0", "P1"):
        w[p].call("tx_open", key, transport, dtype, seed_of(p, dtype), timeout_s=TIMEOUT_S)
    jobs: dict[str, list[tuple[bytes, list[int]]]] = {"P0": [], "P1": []}
    expect: dict[str, list[tuple[str, str, list[int]]]] = {"D0": [], "D1": []}
    for i in range(16):
        d, p = f"D{i % 2}", f"P{(i // 2) % 2}"  # every (P, D) pair carries four transfers
        n = 1 + (i * 23) % 90
        ticket = w[d].call("rx_reserve", key, f"cc-{i}", n)
        src = kv_procs.spread_ids(blocks_for(n), offset=i)
        jobs[p].append((ticket, src))
        expect[d].append((pb.TransferTicket.FromString(ticket).transfer_id, p, src))
    for p in ("P0", "P1"):
        w[p].submit("tx_send", key, jobs[p], concurrent=True)
    for p in ("P0", "P1"):
        assert w[p].result() == [COMPLETE] * 8
    for d in ("D0", "D1"):
        for tid, p, src in expect[d]:
            got = w[d].call("rx_collect", key, tid, seed_of(p, dtype), src, 10.0)
            assert got["status"] == "complete" and got["exact"], got
        chk = assert_clean(cluster, d, key)
        if transport == "torch_dist":
            # One pair per prefill worker, however many threads raced to open it.
            assert chk["num_pairs"] == 2 and chk["broken_pairs"] == 0, chk
    for p in ("P0", "P1"):
        assert w[p].call("tx_num_channels", key) == 2


# ---- a decode engine continues from transferred KV ------------------------------------------
PROMPTS = [[5, 9, 200, 17, 33], list(range(40, 56)), [(7 * i + 3) % 500 + 4 for i in range(37)]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def colocated(cluster: dict[str, Any]) -> list[list[int]]:
    """The reference, computed in a worker: same torch thread count as the engines under test."""
    result: list[list[int]] = cluster["w"]["D0"].call(
        "eng_generate", cluster["checkpoint"], PROMPTS, MAX_TOKENS
    )
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disaggregated_decode_matches_colocated(
    cluster: dict[str, Any], colocated: list[list[int]], transport: str
) -> None:
    w = cluster["w"]
    key = f"engine-{transport}"
    w["D1"].call("eng_open", key, cluster["checkpoint"], "decode", transport)
    w["P1"].call("eng_open", key, cluster["checkpoint"], "prefill", transport)
    for i, prompt in enumerate(PROMPTS):
        rid = f"{key}-{i}"
        ticket = w["D1"].call("eng_reserve", key, rid, prompt, MAX_TOKENS)
        first, src = w["P1"].call("eng_prefill", key, ticket, prompt, MAX_TOKENS)
        assert len(src) == blocks_for(len(prompt))
        out = w["D1"].call("eng_decode", key, rid, first)
        assert out["tokens"] == colocated[i], (prompt, out["tokens"], colocated[i])
        assert out["tokens"][0] == first
        assert out["free"] == out["base_free"]


# ---- a sender dies mid-transfer -------------------------------------------------------------
@pytest.mark.parametrize(
    ("transport", "mode", "victim"),
    [
        ("torch_dist", "after_frame", "V0"),
        ("torch_dist", "mid_frame", "V1"),
        ("grpc", "after_frame", "V2"),
        ("grpc", "mid_frame", "V3"),
    ],
)
def test_killed_sender_fails_only_its_transfer(
    cluster: dict[str, Any], transport: str, mode: str, victim: str
) -> None:
    w = cluster["w"]
    dtype = "float32"
    key = f"{transport}-{dtype}"
    v = w[victim]
    v.call("tx_open", key, transport, dtype, 4321, timeout_s=TIMEOUT_S)
    num_tokens = 16 * 5 + 7
    src = kv_procs.spread_ids(blocks_for(num_tokens))
    ticket = w["D0"].call("rx_reserve", key, f"victim-{victim}", num_tokens)
    tid = pb.TransferTicket.FromString(ticket).transfer_id
    if mode == "after_frame":  # layer 0 landed completely, then the sender goes away
        v.call("tx_push", key, ticket, src, 1)
        frame = blocks_for(num_tokens) * page_bytes(dtype)
        w["D0"].call("rx_progress", key, tid, min_bytes=frame)
    else:  # a frame is half written when the sender goes away
        v.call("tx_push_partial_frame", key, ticket, src)
        assert w["D0"].call("rx_progress", key, tid, in_flight=True)["in_flight"] == 1
        # Meanwhile another pair (P1 -> D0) is not held up by the stuck one.
        transfer(cluster, "D0", "P1", key, f"during-{victim}", 40)

    w["D0"].submit("rx_collect", key, tid, 4321, src, 10.0)
    v.kill()
    got = w["D0"].result()
    assert got["status"] == "failed", got
    # The transport noticed (peer death, or a stall of TIMEOUT_S), not wait()'s own 10 s.
    assert got["elapsed"] < TIMEOUT_S + 2.0, got
    assert "timed out after" not in got["error"], got
    assert got["released"], got
    assert_clean(cluster, "D0", key)
    # The other pairs still work, and the receiver takes new transfers from anyone.
    transfer(cluster, "D0", "P1", key, f"after-{victim}-1", 16 * 3 + 1)
    transfer(cluster, "D0", "P0", key, f"after-{victim}-2", 16 * 2, offset=3)
    assert_clean(cluster, "D0", key)


# ---- headers the receiver must refuse, through a real transport -----------------------------
BAD_KINDS = {**kv_procs.BAD_LAYOUTS, **kv_procs.BAD_FRAMES}


@pytest.mark.parametrize("kind", list(BAD_KINDS))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rejected_before_any_byte_lands(cluster: dict[str, Any], transport: str, kind: str) -> None:
    w = cluster["w"]
    key = f"{transport}-float32"
    num_tokens = 16 * 4 + 5
    src = kv_procs.spread_ids(blocks_for(num_tokens))
    ticket = w["D0"].call("rx_reserve", key, f"bad-{kind}", num_tokens)
    tid = pb.TransferTicket.FromString(ticket).transfer_id
    foreign = cluster["info"]["D0", key]["pinned"][1]  # a block another request owns
    outcome = w["P0"].call("tx_send_bad", key, ticket, src, kind, foreign)
    assert outcome.startswith("TransferRejected"), outcome
    assert BAD_KINDS[kind] in outcome, outcome
    # The rejection failed the reservation: blocks back, and not a byte written anywhere
    # (not in the reservation, not in the foreign block).
    assert w["D0"].call("rx_released", key, tid)
    assert_clean(cluster, "D0", key)
    # The same prefill worker's next transfer to the same decode worker goes through.
    transfer(cluster, "D0", "P0", key, f"after-bad-{kind}", num_tokens, offset=2)


# ---- late frames of an aborted transfer -----------------------------------------------------
@pytest.mark.parametrize("how", ["receiver_fail", "sender_abort"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_late_frames_never_reach_the_new_owner(
    cluster: dict[str, Any], transport: str, how: str
) -> None:
    w = cluster["w"]
    dtype = "float32"
    key = f"late-{transport}-{how}"
    # 8 blocks, 2 pinned by fragment(): a 6-block reservation takes every free block, so the
    # next reservation necessarily reuses the aborted one's blocks.
    w["D1"].call("rx_open", key, transport, dtype, num_blocks=8, timeout_s=TIMEOUT_S)
    w["P0"].call("tx_open", key, transport, dtype, seed_of("P0", dtype), timeout_s=TIMEOUT_S)
    w["P1"].call("tx_open", key, transport, dtype, seed_of("P1", dtype), timeout_s=TIMEOUT_S)
    num_tokens = 16 * 5 + 3  # 6 prompt blocks (+1 token of room fits the 6th)
    src = kv_procs.spread_ids(6)
    old = w["D1"].call("rx_reserve", key, "old", num_tokens)
    old_t = pb.TransferTicket.FromString(old)
    w["P0"].call("tx_push", key, old, src, 1)  # layer 0 lands
    w["D1"].call("rx_progress", key, old_t.transfer_id, min_bytes=6 * page_bytes(dtype))
    if how == "receiver_fail":
        assert w["D1"].call("rx_fail", key, old_t.transfer_id)
    else:
        w["P0"].call("tx_abort", key, old_t.transfer_id, "client went away")
        assert w["D1"].call("rx_released", key, old_t.transfer_id)
    new = w["D1"].call("rx_reserve", key, "new", num_tokens)
    new_t = pb.TransferTicket.FromString(new)
    assert sorted(new_t.dst_block_ids) == sorted(old_t.dst_block_ids)
    # The old transfer's remaining layers arrive late, aimed at blocks "new" now owns.
    outcome = w["P0"].call("tx_finish", key, old_t.transfer_id)
    assert outcome.startswith("TransferRejected"), outcome
    chk = w["D1"].call("rx_check", key, wait_s=0)
    assert chk["untouched"] and chk["pending"] == 1, chk
    # The new owner's transfer is unaffected.
    assert w["P1"].call("tx_send", key, [(new, src)]) == [COMPLETE]
    got = w["D1"].call("rx_collect", key, new_t.transfer_id, seed_of("P1", dtype), src, 10.0)
    assert got["status"] == "complete" and got["exact"], got
    assert_clean(cluster, "D1", key)


# ---- the sender's LRU channel cap -----------------------------------------------------------
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lru_channel_cap(cluster: dict[str, Any], transport: str) -> None:
    w = cluster["w"]
    dtype = "float32"
    key = f"lru-{transport}"
    for d in ("D0", "D1"):
        w[d].call("rx_open", key, transport, dtype, timeout_s=TIMEOUT_S)
    w["P0"].call(
        "tx_open",
        key,
        transport,
        dtype,
        seed_of("P0", dtype),
        timeout_s=TIMEOUT_S,
        max_channels=1,
    )
    for i, d in enumerate(("D0", "D1", "D0", "D1")):
        transfer(cluster, d, "P0", key, f"lru-{i}", 16 * 2 + i, offset=i)
        assert w["P0"].call("tx_num_channels", key) == 1
    for d in ("D0", "D1"):
        chk = assert_clean(cluster, d, key)
        if transport == "torch_dist":  # each visit after an eviction opened a fresh pair
            assert chk["num_pairs"] == 2 and chk["broken_pairs"] == 0, chk


# ---- a decode worker dies under a sender ----------------------------------------------------
def test_killed_receiver_fails_the_senders_transfer(cluster: dict[str, Any]) -> None:
    """The prefill side gets a TransferError (nothing else) in bounded time, drops the dead
    pair, and keeps serving every other decode worker."""
    w = cluster["w"]
    v = w["V4"]
    dtype = "float32"
    src = kv_procs.spread_ids(3)
    pending: dict[str, tuple[str, bytes, int]] = {}
    for tr in TRANSPORTS:
        key = f"{tr}-{dtype}"
        v.call("rx_open", key, tr, dtype, timeout_s=TIMEOUT_S)
        ticket = v.call("rx_reserve", key, "doomed", 40)
        unsent = v.call("rx_reserve", key, "never-sent", 40)
        channels = w["P0"].call("tx_num_channels", key)
        tid = w["P0"].call("tx_push", key, ticket, src, 1)  # layer 0 is out
        pending[tr] = (tid, unsent, channels)
    v.kill()
    for tr, (tid, unsent, channels) in pending.items():
        key = f"{tr}-{dtype}"
        t0 = time.monotonic()
        outcome = w["P0"].call("tx_finish", key, tid)
        assert outcome.startswith("TransferError"), outcome
        assert time.monotonic() - t0 < TIMEOUT_S + 3.0
        # The dead pair was dropped; a new transfer to the dead address fails the same way.
        assert w["P0"].call("tx_num_channels", key) == channels
        t0 = time.monotonic()
        [outcome] = w["P0"].call("tx_send", key, [(unsent, src)])
        assert outcome.startswith("TransferError"), outcome
        assert time.monotonic() - t0 < TIMEOUT_S + 3.0
        assert w["P0"].call("tx_num_channels", key) == channels
        transfer(cluster, "D0", "P0", key, f"after-dead-decode-{tr}", 16 * 2 + 3)
        assert_clean(cluster, "D0", key)


# ---- CUDA caches over NCCL ------------------------------------------------------------------
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="an NCCL pair needs two CUDA devices (NCCL cannot pair a device with itself)",
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_dist_nccl_between_gpus(dtype: str) -> None:
    d, p = Worker("GD"), Worker("GP")
    try:
        key = f"nccl-{dtype}"
        d.call("rx_open", key, "torch_dist", dtype, timeout_s=20.0, device="cuda:0", timeout=120)
        p.call(
            "tx_open", key, "torch_dist", dtype, 77, timeout_s=20.0, device="cuda:1", timeout=120
        )
        num_tokens = 16 * 5 + 7
        src = kv_procs.spread_ids(blocks_for(num_tokens))
        ticket = d.call("rx_reserve", key, "gpu", num_tokens)
        tid = pb.TransferTicket.FromString(ticket).transfer_id
        assert p.call("tx_send", key, [(ticket, src)], timeout=120) == [COMPLETE]
        got = d.call("rx_collect", key, tid, 77, src, 30.0)
        assert got["status"] == "complete" and got["exact"], got
        chk = d.call("rx_check", key)
        assert chk["untouched"] and chk["free"] == chk["base_free"], chk
    finally:
        shutdown([d, p])


# ---- torch_dist pairing that no outsider can wedge ---------------------------------------------
PAIRING_BOUND_S = 3.0  # well under the 10 s transfer timeout a strictly ordered receiver hit
SECRET = "mp-kv-secret-0123456789abcdef"
WRONG_SECRET = "mp-other-secret-0123456789abcdef"


def test_torch_dist_pairs_after_an_outsider_draws_a_pair_number(cluster: dict[str, Any]) -> None:
    """An outsider draws the next pair number from D1's store and never registers it (as a
    sender killed between the two would): the next senders, other processes, still pair and
    transfer bit for bit at once, not after the transfer timeout, and not never."""
    import datetime

    import torch.distributed as dist

    w = cluster["w"]
    key = "pairing-outsider"
    info = w["D1"].call("rx_open", key, "torch_dist", "float32", timeout_s=10.0)
    host, port = info["address"].rsplit(":", 1)
    outsider = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=5))
    assert outsider.add("next_pair", 1) == 1
    for p in ("P0", "P1"):
        w[p].call("tx_open", key, "torch_dist", "float32", seed_of(p, "float32"), timeout_s=10.0)
        t0 = time.monotonic()
        transfer(cluster, "D1", p, key, f"after-outsider-{p}", 16 * 3 + 5)
        assert time.monotonic() - t0 < PAIRING_BOUND_S
    chk = assert_clean(cluster, "D1", key)
    assert chk["num_pairs"] == 2 and chk["broken_pairs"] == 0, chk
    assert w["D1"].call("rx_pairs", key)["skipped_pairs"] == 0  # number 0 waits out its 10 s


def test_torch_dist_wrong_secret_refused_then_right_one_pairs(cluster: dict[str, Any]) -> None:
    """With a secret, P0 holding another one is refused (no byte lands, the reservation
    stays), then P1 holding the right one pairs and lands the same ticket."""
    w = cluster["w"]
    key = "pairing-secret"
    w["D1"].call("rx_open_with_secret", key, SECRET, timeout_s=TIMEOUT_S)
    w["P0"].call("tx_open_with_secret", key, WRONG_SECRET, seed_of("P0", "float32"))
    w["P1"].call("tx_open_with_secret", key, SECRET, seed_of("P1", "float32"))
    num_tokens = 16 * 2 + 3
    src = kv_procs.spread_ids(blocks_for(num_tokens))
    ticket = w["D1"].call("rx_reserve", key, "secret", num_tokens)
    tid = pb.TransferTicket.FromString(ticket).transfer_id
    t0 = time.monotonic()
    [outcome] = w["P0"].call("tx_send", key, [(ticket, src)])
    assert outcome.startswith("TransferUnauthenticated"), outcome
    assert "authentication failed" in outcome, outcome
    assert time.monotonic() - t0 < PAIRING_BOUND_S
    assert w["D1"].call("rx_progress", key, tid)["bytes"] == 0
    assert w["D1"].call("rx_pairs", key)["refused_pairs"] == 1
    t0 = time.monotonic()
    assert w["P1"].call("tx_send", key, [(ticket, src)]) == [COMPLETE]
    assert time.monotonic() - t0 < PAIRING_BOUND_S
    got = w["D1"].call("rx_collect", key, tid, seed_of("P1", "float32"), src, 10.0)
    assert got["status"] == "complete" and got["exact"], got
    assert_clean(cluster, "D1", key)
    pairs = w["D1"].call("rx_pairs", key)
    assert pairs["num_pairs"] == 2 and pairs["refused_pairs"] == 1, pairs
