"""Timing real KV transfers between two processes: what `pdserve profile` fits (validation
lane B) and what `make bench-transfer` compares with raw ceilings.

A receiving process owns a `PagedKVCache` with a `KVReceiver` and an endpoint per transport
(`PageReceiver`); the sending side owns source pages and a `KVSender` (`PageSender`). Either
side may run in a child process (`PeerProcess`): a command loop over a `multiprocessing`
pipe, ``(op, kwargs)`` in, ``("ok", result)`` or ``("err", traceback)`` out. Tickets cross
the pipe as serialized `TransferTicket` bytes, as a router carries them.

What must hold: a child never outlives its parent (it exits when the parent goes, even
mid-transfer), and one that hangs is terminated, then killed, on every exit path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig, ModelConfig
from engine.kv_cache import DTYPES, PagedKVCache
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.transports.base import Endpoint, get_transport
from protos.pdserve.v1 import kv_transfer_pb2 as pb

HOST = "127.0.0.1"
FINGERPRINT = "kv-transfer-probe"
TIMEOUT_S = 120.0


def page_cache(
    model: ModelConfig, block_size: int, num_blocks: int, dtype: str = "bfloat16"
) -> PagedKVCache:
    """A KV cache of a model's layout, with no weights behind it."""
    return PagedKVCache(
        model,
        CacheConfig(block_size, num_blocks),
        DTYPES[dtype],
        fingerprint=FINGERPRINT,
    )


def checksum(cache: PagedKVCache, ids: Sequence[int]) -> list[int]:
    """Per (layer, K/V, position in `ids`) int16 sums of the pages: order-sensitive."""
    idx = torch.tensor(list(ids), dtype=torch.long)
    raw = cache.data.view(torch.int16).index_select(2, idx)  # [L, 2, n, Bs, H, D]
    return raw.sum(dim=(3, 4, 5), dtype=torch.int64).flatten().tolist()


class PageReceiver:
    """The decode side: a page cache, and a receiver and endpoint per key."""

    def __init__(self) -> None:
        self.rx: dict[str, KVReceiver] = {}
        self.endpoints: list[Endpoint] = []
        self.cache: PagedKVCache | None = None
        self.pool: dict[str, str] = {}  # key -> "fresh" | "scattered" | "live"
        self.n = 0

    def setup_pages(
        self, model: ModelConfig, block_size: int, num_blocks: int, dtype: str = "bfloat16"
    ) -> None:
        self.cache = page_cache(model, block_size, num_blocks, dtype)

    def listen(self, key: str, transport: str, pool: str = "fresh") -> str:
        """A receiver + endpoint on the page cache. `pool` decides the destination block ids:
        "fresh": a new pool per reserve, ids ascending, one run per layer (the best case);
        "scattered": a fragmented pool, as a long-running worker's can be: every other block
        held by someone else, the rest freed in random order, so every block is a run of its
        own (the worst case; the receiving cache needs twice the blocks for it);
        "live": one pool used as is, as the decode worker's."""
        assert self.cache is not None, "setup_pages first"
        return self.listen_on(key, transport, self.cache, pool)

    def listen_on(self, key: str, transport: str, cache: PagedKVCache, pool: str) -> str:
        rx = KVReceiver(
            cache, BlockManager(cache.num_blocks, cache.block_size), transport=transport
        )
        ep = get_transport(transport, timeout_s=TIMEOUT_S).listen(rx, HOST)
        rx.address = ep.address
        self.rx[key] = rx
        self.pool[key] = pool
        self.endpoints.append(ep)
        return ep.address

    def reserve(self, key: str, num_tokens: int) -> bytes:
        rx = self.rx[key]
        self.n += 1
        if self.pool[key] != "live":
            assert rx.pending() == 0
            rx.blocks = BlockManager(rx.cache.num_blocks, rx.cache.block_size)
        if self.pool[key] == "scattered":  # public API only: take every block, free the
            # even ones in random order. The block manager hands fresh blocks out in ascending
            # order, so shuffling alone would leave one run; the held odd blocks split them.
            for b in range(rx.cache.num_blocks):
                rx.blocks.allocate(f"churn-{b}", [], rx.cache.block_size)  # churn-b holds b
            evens = np.arange(0, rx.cache.num_blocks, 2)
            for b in np.random.default_rng(self.n).permutation(evens).tolist():
                rx.blocks.free(f"churn-{b}")
        return rx.reserve(f"req-{self.n}", num_tokens, extra_tokens=0).SerializeToString()

    def release(self, key: str, transfer_id: str, want_checksum: bool = False) -> list[int]:
        """Wait for the transfer to land, take it, free its blocks; its pages' checksum."""
        rx = self.rx[key]
        res = rx.wait(transfer_id, TIMEOUT_S)
        rx.take(transfer_id)
        sums = checksum(rx.cache, res.dst_block_ids) if want_checksum else []
        with rx.lock:
            rx.blocks.free(res.request_id)
        return sums

    def cpu(self) -> float:
        """CPU seconds this process has used (all threads: transport, store, copies)."""
        return time.process_time()

    def close(self) -> None:
        for ep in self.endpoints:
            with contextlib.suppress(Exception):
                ep.close()
        self.endpoints.clear()
        self.rx.clear()


class PageSender:
    """The prefill side: source pages (seeded random) and a sender per key."""

    def __init__(self) -> None:
        self.cache: PagedKVCache | None = None
        self.senders: dict[str, KVSender] = {}

    def setup_pages(
        self,
        model: ModelConfig,
        block_size: int,
        num_blocks: int,
        dtype: str = "bfloat16",
        seed: int = 0,
    ) -> None:
        self.cache = page_cache(model, block_size, num_blocks, dtype)
        torch.manual_seed(seed)
        self.cache.data.normal_()

    def sender(self, key: str, transport: str, cache: PagedKVCache) -> KVSender:
        if key not in self.senders:
            tr = get_transport(transport, timeout_s=TIMEOUT_S)
            self.senders[key] = KVSender(cache, "probe-tx", tr, timeout_s=TIMEOUT_S)
        return self.senders[key]

    def send(self, transport: str, ticket: bytes, src_ids: list[int]) -> float:
        """One whole transfer, `KVSender.send` to the receiver's acknowledgement: seconds."""
        assert self.cache is not None, "setup_pages first"
        sender = self.sender(transport, transport, self.cache)
        t = pb.TransferTicket.FromString(ticket)
        t0 = time.perf_counter()
        ack = sender.send(t, src_ids)
        dt = time.perf_counter() - t0
        if ack.status != pb.TRANSFER_STATUS_COMPLETE:
            raise RuntimeError(f"{transport}: transfer not complete: {ack}")
        return dt

    def checksum(self, ids: list[int]) -> list[int]:
        assert self.cache is not None
        return checksum(self.cache, ids)

    def close(self) -> None:
        for s in self.senders.values():
            with contextlib.suppress(Exception):
                s.close()
        self.senders.clear()


# ---- child processes ---------------------------------------------------------------------


def _watch_parent(ppid: int) -> None:
    """Exit hard if the parent goes away (even mid-transfer), so no process is orphaned."""

    def loop() -> None:
        while True:
            if os.getppid() != ppid:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=loop, name="watch-parent", daemon=True).start()


def peer_main(
    factory: Callable[[], Any],
    conn: Connection,
    ppid: int,
    threads: int,
    cores: Sequence[int] | None,
) -> None:
    """A child's command loop: calls `op(**kwargs)` on the object `factory` builds."""
    _watch_parent(ppid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    if cores:
        os.sched_setaffinity(0, list(cores))
    torch.set_num_threads(threads)
    peer = factory()
    code = 0
    try:
        while True:
            try:
                op, kwargs = conn.recv()
            except (EOFError, OSError):
                break
            if op == "stop":
                with contextlib.suppress(Exception):
                    peer.close()
                conn.send(("ok", None))
                break
            try:
                conn.send(("ok", getattr(peer, op)(**kwargs)))
            except BaseException:
                conn.send(("err", traceback.format_exc()))
    except BaseException:
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # gloo/gRPC threads must not keep a finished child alive


class PeerProcess:
    """A spawned child serving `factory()`'s methods, and its command pipe."""

    def __init__(
        self,
        ctx: Any,
        name: str,
        factory: Callable[[], Any],
        threads: int = 1,
        cores: Sequence[int] | None = None,
    ) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=peer_main,
            args=(factory, child, os.getpid(), threads, list(cores) if cores else None),
            name=name,
        )
        self.proc.start()
        child.close()

    def send(self, op: str, **kwargs: Any) -> None:
        self.conn.send((op, kwargs))

    def result(self, timeout: float = 300.0) -> Any:
        try:
            if not self.conn.poll(timeout):
                raise TimeoutError(f"{self.name}: no reply within {timeout:.0f} s")
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1.0)
            raise RuntimeError(
                f"{self.name} process ended (exit code {self.proc.exitcode})"
            ) from None
        if status == "err":
            raise RuntimeError(f"{self.name} process failed:\n{value}")
        return value

    def call(self, op: str, timeout: float = 300.0, **kwargs: Any) -> Any:
        self.send(op, **kwargs)
        return self.result(timeout)

    def stop(self, graceful: bool = True) -> None:
        """Ask the child to close its endpoints and exit; terminate it when it does not (or at
        once when not `graceful`, e.g. after an error or a signal, when it may be mid-call)."""
        if graceful and self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("stop", {}))
                if self.conn.poll(5.0):
                    self.conn.recv()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3.0)
        with contextlib.suppress(Exception):
            self.conn.close()
