"""torch.distributed point-to-point transport: gloo for CPU caches, NCCL for CUDA caches.

One two-rank process group per (prefill worker, decode worker) pair, created lazily, with
no global world: the decode worker hosts a `TCPStore` (its ticket's `channel_address`,
listening on `transfer.host` only); a sender draws pair number ``i`` from ``next_pair``,
registers it under ``pair/<i>`` and both sides build a group on
``PrefixStore("pg/<i>", store)``. Registrations are served as they appear, in any order: a
number nobody registers in time is skipped and holds up no later pair (`PairWatch`). Control
and data take separate paths:

* headers (and acks, and abort/close frames) go over a plain TCP **control connection** per
  pair, to a port the decode worker names in the pair's challenge, as length-prefixed
  sealed protobuf records. Each side reads it with blocking socket reads: nothing polls, so
  an idle or waiting pair costs no CPU (on a small box, polling threads steal cycles from the
  prefill they overlap), a header or ack is seen one loopback hop after it is written, and a
  peer that dies closes the connection, which fails its transfers at once. An idle pair
  holds no posted gloo receive, so no collective timeout can fire while idle;
* payload regions go over the group as raw uint8 sends, straight from the sender's pages
  into the receiver's reserved pages, after the receiver validated the header.

Before either side builds the group, the pair authenticates under ``auth/<i>/...``
(kv_transfer/auth.py), on a store connection of its own (a c10d client runs one request at a
time: one pair's wait would hold up every other's): the receiver writes a fresh ``nonce``
(with its control port), the sender answers with a ``proof`` (an HMAC under the shared
secret, or empty without one), and the receiver writes a ``verdict``: its own proof,
``open`` (no secret) or ``refused: ...``. A refused pair never gets a group; at most
`_MAX_AUTHENTICATING` pairs are in their challenge at once. The control connection opens
with a ``hello`` sealed with a per-pair key derived from the nonce, and every record on it is
sealed too, so a connection claiming a pair it did not authenticate is refused. The store
and the control connection are plaintext: the secret gates pairing and control records, not
the gloo or NCCL payload connections (docs/lifecycle.md, "Channel authentication").

A pair that breaks (peer died, stalled past the timeout, undecodable frame) fails the
transfers it carried and is dropped; other pairs are separate groups and carry on.

This module serves and sends frames; how a pair comes to be (its store keys, the challenge,
the control connection's records, the group) is in `torch_dist_pairing`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kv_transfer.auth import RecordSeal
from kv_transfer.receiver import KVReceiver, ack_of
from kv_transfer.transports.base import Endpoint, SendChannel, Transport, register
from kv_transfer.transports.torch_dist_pairing import (
    VERDICT_REFUSED,
    PairGroup,
    PairRefused,
    PairSlot,
    PairWatch,
    Records,
    answer,
    auth_key,
    challenge,
    claim_pair,
    ctl_key,
    host_store,
    listen_socket,
    make_pair_group,
    own_connection,
    refuse_busy,
    td,
)
from kv_transfer.wire import (
    TransferError,
    TransferRejected,
    TransferUnauthenticated,
    as_bytes,
    block_runs,
)
from protos.pdserve.v1 import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

CLOSE_REASON = "pair closed"
_ELEM_BYTES = {pb.KV_DTYPE_FLOAT32: 4, pb.KV_DTYPE_BFLOAT16: 2, pb.KV_DTYPE_FLOAT16: 2}
_MAX_DRAIN_BYTES = 1 << 30
_POLL_PAIRS_S = 0.01  # how often the endpoint looks for new pairs in its store
_MAX_AUTHENTICATING = 64  # pairs in their challenge at once; more are turned away busy


class TorchDistEndpoint(Endpoint):
    def __init__(
        self, receiver: KVReceiver, host: str, timeout_s: float, secret: str | None = None
    ) -> None:
        self.receiver = receiver
        self.timeout_s = timeout_s
        self._secret = secret
        self.store = host_store(host, max(timeout_s, 30.0))
        self.address = f"{host}:{self.store.port}"
        self._listener = listen_socket(host)
        self._ctl_port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self.num_pairs = 0  # registrations served (challenged)
        self.skipped_pairs = 0  # pair numbers drawn but never registered within timeout_s
        self.broken_pairs = 0
        self.refused_pairs = 0  # failed authentication: never given a group
        self.busy_pairs = 0  # turned away before their challenge: too many authenticating
        self._authenticating = 0
        self.refused_connections = 0  # control connections claiming a pair they cannot seal
        self._lock = threading.Lock()
        self._seals: dict[int, RecordSeal] = {}  # pair -> its records' seal (after auth)
        self._pending: dict[int, PairSlot] = {}  # pair -> its control connection, once here
        self._threads = [
            threading.Thread(target=self._accept, name="kv-accept", daemon=True),
            threading.Thread(target=self._accept_control, name="kv-accept-ctl", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _slot(self, pair: int) -> PairSlot:
        with self._lock:
            return self._pending.setdefault(pair, PairSlot())

    def _accept(self) -> None:
        """Serve registrations as they appear, in any order, on a store connection of its own."""
        watch = PairWatch(self.timeout_s)
        store: dist.Store | None = None
        while not self._closed.wait(_POLL_PAIRS_S):
            try:
                store = store or own_connection(self.store)
                found = watch.poll(store)
            except Exception as e:  # c10d drops a client whose request failed: reconnect
                log.warning("kv pair registrations: store poll failed: %s", e)
                store = None
                self._closed.wait(1.0)
                continue
            self.skipped_pairs = watch.skipped
            for pair, sender in found:
                self._start_pair(store, pair, sender)

    def _start_pair(self, store: dist.Store, pair: int, sender: str) -> None:
        t = threading.Thread(
            target=self._serve_pair, args=(pair, sender), name=f"kv-pair-{pair}", daemon=True
        )
        with self._lock:  # close() joins every thread started before it
            if self._closed.is_set():
                return
            busy = self._authenticating >= _MAX_AUTHENTICATING
            if not busy:
                self._authenticating += 1
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
                t.start()
        self.num_pairs += 1
        if busy:
            self.busy_pairs += 1
            log.warning("kv pair %d from %r turned away: too many authenticating", pair, sender)
            with contextlib.suppress(Exception):  # unsaid, its sender waits out its timeout
                refuse_busy(store, pair, f"more than {_MAX_AUTHENTICATING} pairs authenticating")

    def _accept_control(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._hello, args=(conn,), name="kv-ctl-hello", daemon=True
            ).start()

    def _hello(self, conn: socket.socket) -> None:
        """Bind a control connection to the pair its sealed hello names, or refuse it."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        records = Records(conn)
        try:
            record = records.read(self.timeout_s)
            if record is None:  # said nothing in time
                raise EOFError
            pair = int(record[:24].split(b":")[0])
        except (OSError, EOFError, ValueError):
            records.close()
            return
        slot = self._slot(pair)
        seal = slot.sealed.wait(self.timeout_s) and self._seals.get(pair)
        name = f"hello/{pair}"
        body = seal.open(name, record[record.index(b":") + 1 :]) if seal else None
        with self._lock:
            ok = body == b"hello" and slot.records is None and not self._closed.is_set()
            if ok:
                slot.records = records
            elif not slot.sealed.is_set() and self._pending.get(pair) is slot:
                del self._pending[pair]  # a pair nobody authenticated: keep no slot for it
        if not ok:
            self.refused_connections += 1
            log.warning("kv control connection claiming pair %d refused", pair)
            records.close()
            return
        slot.connected.set()

    def _challenge(self, pair: int, sender: str) -> tuple[dist.Store, RecordSeal] | None:
        """Authenticate the pair's sender on a store connection of its own; that connection
        and the records' seal, or None when refused (counted before the verdict is written)."""
        try:
            store = own_connection(self.store)
            try:
                args = (self._secret, self.timeout_s, self._ctl_port, self._closed)
                return store, challenge(store, pair, sender, *args)
            except PairRefused as e:
                self._refuse(store, pair, sender, str(e))
        except Exception as e:  # the store connection failed (tampered keys, closing)
            log.warning("kv pair %d from %r: challenge failed: %s", pair, sender, e)
        finally:
            with self._lock:
                self._authenticating -= 1
        return None

    def _refuse(self, store: dist.Store, pair: int, sender: str, why: str) -> None:
        self.refused_pairs += 1
        store.set(auth_key(pair, "verdict"), VERDICT_REFUSED + why)
        log.warning("kv pair %d from %r refused: %s", pair, sender, why)

    def _serve_pair(self, pair: int, sender: str) -> None:
        authenticated = self._challenge(pair, sender)
        if authenticated is None:
            return
        store, seal = authenticated
        slot = self._slot(pair)
        self._seals[pair] = seal
        slot.sealed.set()
        try:
            group = make_pair_group(
                dist.PrefixStore(f"pg/{pair}", store),
                1,
                self.receiver.cache.device,
                self.timeout_s,
            )
        except Exception as e:
            log.warning("kv pair %d from %s: rendezvous failed: %s", pair, sender, e)
            return
        if not slot.connected.wait(self.timeout_s) or slot.records is None:
            log.warning("kv pair %d from %s: no control connection", pair, sender)
            return
        records = slot.records
        try:
            self._serve_frames(pair, sender, seal, group, records)
        finally:
            records.close()
            with self._lock:
                self._pending.pop(pair, None)
                self._seals.pop(pair, None)

    def _serve_frames(
        self, pair: int, sender: str, seal: RecordSeal, group: PairGroup, records: Records
    ) -> None:
        acks = _AckWriter(records, seal)
        active: dict[str, float] = {}  # transfer id -> time of its last frame
        seq = 0
        while not self._closed.is_set():
            # Block until the next header, or until the oldest active transfer would stall.
            oldest = min(active.values(), default=None)
            wait_s = (
                None if oldest is None else max(oldest + self.timeout_s - time.monotonic(), 1e-3)
            )
            try:
                record = records.read(wait_s)
            except (OSError, EOFError) as e:
                if active and not self._closed.is_set():
                    self._break(pair, active, f"control connection from {sender} lost: {e}")
                return
            if record is None:
                self._expire_stalled(active, sender)
                continue
            key = ctl_key(pair, f"frame/{seq}")
            seq += 1
            raw = seal.open(key, record)
            if raw is None:
                self._break(pair, active, f"frame record {seq - 1} failed authentication")
                return
            try:
                header = pb.KVFrameHeader.FromString(raw)
            except Exception:
                self._break(pair, active, f"undecodable frame header from {sender}")
                return
            if header.abort:
                if not header.transfer_id and header.abort_reason == CLOSE_REASON:
                    return
                self.receiver.fail(header.transfer_id, f"aborted by sender: {header.abort_reason}")
                active.pop(header.transfer_id, None)
                continue
            if not self._receive(pair, acks, group, header, active, sender):
                return

    def _receive(
        self,
        pair: int,
        acks: _AckWriter,
        group: PairGroup,
        header: pb.KVFrameHeader,
        active: dict[str, float],
        sender: str,
    ) -> bool:
        """Land one frame; False when the pair is broken and must be dropped."""
        try:
            res, regions = self.receiver.begin_frame(header)
        except TransferRejected as e:
            acks.send(
                pair,
                pb.TransferAck(
                    transfer_id=header.transfer_id, status=pb.TRANSFER_STATUS_REJECTED, error=str(e)
                ),
            )
            if not self._drain(group, header):
                self._break(pair, active, f"cannot drain rejected frame from {sender}")
                return False
            return True
        active[header.transfer_id] = time.monotonic()
        try:
            works = [group.recv([as_bytes(r)], 0, 0) for r in regions]
            for w in works:
                w.wait(td(self.timeout_s))
        except Exception as e:
            self.receiver.end_frame(res, header, error=f"peer {sender} broke off: {e}")
            active.pop(header.transfer_id, None)
            self._break(pair, active, f"peer {sender} broke off mid-frame")
            return False
        self.receiver.end_frame(res, header)
        if res.done.is_set():
            active.pop(header.transfer_id, None)
            acks.send(pair, ack_of(res))
        else:
            active[header.transfer_id] = time.monotonic()
        return True

    def _drain(self, group: PairGroup, header: pb.KVFrameHeader) -> bool:
        """Receive and discard a rejected frame's payload, so the pair stays in step."""
        sizes = _region_sizes(header)
        if sizes is None:
            return False
        scratch = torch.empty(
            max(sizes, default=0), dtype=torch.uint8, device=self.receiver.cache.device
        )
        try:
            for n in sizes:
                group.recv([scratch[:n]], 0, 0).wait(td(self.timeout_s))
        except Exception:
            return False
        return True

    def _expire_stalled(self, active: dict[str, float], sender: str) -> None:
        now = time.monotonic()
        for tid, last in list(active.items()):
            if now - last >= self.timeout_s:
                self.receiver.fail(tid, f"sender {sender} stalled for {self.timeout_s:.1f} s")
                del active[tid]

    def _break(self, pair: int, active: dict[str, float], why: str) -> None:
        self.broken_pairs += 1
        for tid in active:
            self.receiver.fail(tid, why)
        active.clear()
        log.warning("kv pair %d: %s", pair, why)

    def close(self) -> None:
        """Stop accepting and serving; waits for the pair threads, so every pair's group is
        torn down here (a group still alive at interpreter exit aborts the process). Closing
        the sockets wakes every thread blocked on one."""
        with self._lock:
            self._closed.set()
            slots = list(self._pending.values())
            threads = list(self._threads)
        with contextlib.suppress(OSError):  # shutdown, not just close, wakes accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for slot in slots:
            slot.sealed.set()
            slot.connected.set()
            if slot.records is not None:
                slot.records.close()
        for t in threads:
            t.join(self.timeout_s + 1.0)


class _AckWriter:
    """The receiving side's acknowledgements for one pair; the first answer stands."""

    def __init__(self, records: Records, seal: RecordSeal) -> None:
        self.records = records
        self.seal = seal
        self.num_sent = 0
        self._answered: set[str] = set()

    def send(self, pair: int, ack: pb.TransferAck) -> None:
        if ack.transfer_id in self._answered:
            return  # later frames of a rejected transfer (they are rejected as unknown)
        if len(self._answered) >= 4096:  # bounded; transfer ids are never reused
            self._answered.clear()
        self._answered.add(ack.transfer_id)
        key = ctl_key(pair, f"ack/{self.num_sent}")
        with contextlib.suppress(OSError):  # the sender is gone: nobody waits for it
            self.records.write(self.seal.seal(key, ack.SerializeToString()))
        self.num_sent += 1


def _region_sizes(h: pb.KVFrameHeader) -> list[int] | None:
    """Byte sizes of a frame's regions as the *sender* laid them out, from its header."""
    elem = _ELEM_BYTES.get(h.layout.dtype)
    page = h.layout.block_size * h.layout.num_kv_heads * h.layout.head_dim
    if elem is None or not h.src_block_ids or len(h.src_block_ids) != len(h.dst_block_ids):
        return None
    runs = block_runs(h.src_block_ids, h.dst_block_ids)
    per_layer = [n for run in runs for n in (run.num_blocks * page * elem,) * 2]
    sizes = per_layer * max(h.layer_end - h.layer_start, 0)
    if sum(sizes) != h.payload_bytes or sum(sizes) > _MAX_DRAIN_BYTES:
        return None
    return sizes


@dataclass
class _AckSlot:
    done: threading.Event = field(default_factory=threading.Event)
    ack: pb.TransferAck | None = None


class TorchDistChannel(SendChannel):
    def __init__(
        self,
        address: str,
        sender_id: str,
        device: torch.device,
        timeout_s: float,
        secret: str | None = None,
    ) -> None:
        host, port = address.rsplit(":", 1)
        self.address = address
        self.timeout_s = timeout_s
        # c10d's client retries a refused connect with backoff until its timeout, so a dead
        # decode worker would cost seconds per attempt; a plain TCP probe fails in
        # milliseconds and keeps "peer is gone" distinct from "peer is slow".
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        self.store = dist.TCPStore(host, int(port), None, False, timeout=td(timeout_s))
        self.pair = claim_pair(self.store, sender_id)
        self.seal, ctl_port = answer(self.store, self.pair, sender_id, secret, address)
        self.group = make_pair_group(
            dist.PrefixStore(f"pg/{self.pair}", self.store), 0, device, timeout_s
        )
        sock = socket.create_connection((host, ctl_port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._records = Records(sock)
        hello = self.seal.seal(f"hello/{self.pair}", b"hello")
        self._records.write(f"{self.pair}:".encode() + hello)
        self._seq = 0
        self._lock = threading.Lock()
        self._works: dict[str, list[dist.Work]] = {}
        # Sends of aborted transfers, kept until done: a dropped gloo Work cancels its send,
        # and the receiver, waiting for those bytes, would close the pair under every other
        # transfer on it after `timeout_s`.
        self._orphans: list[dist.Work] = []
        self._slots: dict[str, _AckSlot] = {}  # transfer id -> its answer, once it came
        self._reader_error: str | None = None
        self._closing = False
        self.broken = False
        self._reader = threading.Thread(
            target=self._read_acks, name=f"kv-acks-{self.pair}", daemon=True
        )
        self._reader.start()

    # ---- acknowledgements ----------------------------------------------------------------
    def _read_acks(self) -> None:
        n = 0
        while True:
            try:
                record = self._records.read(None)
            except (OSError, EOFError) as e:
                if not self._closing:
                    self._fail_waiters(f"lost {self.address} awaiting acknowledgements: {e}")
                return
            if record is None:
                continue
            key = ctl_key(self.pair, f"ack/{n}")
            body = self.seal.open(key, record)
            if body is None:
                self._fail_waiters(f"an ack from {self.address} failed authentication")
                return
            n += 1
            try:
                ack = pb.TransferAck.FromString(body)
            except Exception:
                self._fail_waiters(f"undecodable acknowledgement from {self.address}")
                return
            with self._lock:
                slot = self._slots.get(ack.transfer_id)  # none: aborted, or finish gave up
            if slot is not None and slot.ack is None:
                slot.ack = ack
                slot.done.set()

    def _fail_waiters(self, why: str) -> None:
        self.broken = True
        with self._lock:
            self._reader_error = why
            slots = list(self._slots.values())
        for slot in slots:
            slot.done.set()

    def _put_header(self, header: pb.KVFrameHeader) -> None:
        key = ctl_key(self.pair, f"frame/{self._seq}")
        self._records.write(self.seal.seal(key, header.SerializeToString()))
        self._seq += 1

    def send_frame(self, header: pb.KVFrameHeader, regions: Sequence[torch.Tensor]) -> None:
        if self.broken:
            raise TransferError(f"channel to {self.address} is broken")
        try:
            with self._lock:
                self._slots.setdefault(header.transfer_id, _AckSlot())
                self._put_header(header)
                works = [self.group.send([as_bytes(r)], 1, 0) for r in regions]
                self._works.setdefault(header.transfer_id, []).extend(works)
        except Exception as e:  # control connection or gloo pair gone: the receiver died
            self.broken = True
            raise TransferError(
                f"transfer {header.transfer_id}: send to {self.address} failed: {e}"
            ) from e

    def finish(self, transfer_id: str, timeout_s: float) -> pb.TransferAck:
        with self._lock:
            slot = self._slots.setdefault(transfer_id, _AckSlot())
            if self._reader_error is not None:
                slot.done.set()
        try:
            try:
                for w in self._works.pop(transfer_id, []):
                    w.wait(td(timeout_s))
            except Exception as e:
                self.broken = True
                # A receiver that rejected a frame it cannot drain (its header does not say
                # how the payload splits) drops the pair; its REJECTED ack names the reason.
                slot.done.wait(min(timeout_s, 1.0))
                if slot.ack is not None and slot.ack.status == pb.TRANSFER_STATUS_REJECTED:
                    raise TransferRejected(f"transfer {transfer_id}: {slot.ack.error}") from e
                raise TransferError(
                    f"transfer {transfer_id}: send to {self.address} failed: {e}"
                ) from e
            if not slot.done.wait(timeout_s):
                raise TransferError(
                    f"transfer {transfer_id}: no acknowledgement from "
                    f"{self.address} within {timeout_s:.1f} s"
                )
        finally:
            with self._lock:
                self._slots.pop(transfer_id, None)
        ack = slot.ack
        if ack is None:
            raise TransferError(f"transfer {transfer_id}: {self._reader_error or 'no answer'}")
        if ack.status == pb.TRANSFER_STATUS_REJECTED:
            raise TransferRejected(f"transfer {transfer_id}: {ack.error}")
        if ack.status != pb.TRANSFER_STATUS_COMPLETE:
            raise TransferError(f"transfer {transfer_id}: {ack.error or 'not complete'}")
        return ack

    def abort(self, header: pb.KVFrameHeader) -> None:
        with self._lock:
            self._orphans = [w for w in self._orphans if not w.is_completed()]
            self._orphans += self._works.pop(header.transfer_id, [])
            self._slots.pop(header.transfer_id, None)
            self._put_header(header)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(Exception), self._lock:
            self._put_header(pb.KVFrameHeader(abort=True, abort_reason=CLOSE_REASON))
        self._records.close()  # wakes the ack reader
        # Let it finish here: a reader still holding this channel at interpreter exit could
        # drop the last reference to the gloo group on a dying thread (std::terminate).
        if self._reader is not threading.current_thread():
            self._reader.join(self.timeout_s)


@register
class TorchDistTransport(Transport):
    name = "torch_dist"

    def listen(self, receiver: KVReceiver, host: str = "127.0.0.1") -> Endpoint:
        return TorchDistEndpoint(receiver, host, self.timeout_s, self.secret)

    def connect(self, address: str, sender_id: str) -> SendChannel:
        try:
            return TorchDistChannel(address, sender_id, self.device, self.timeout_s, self.secret)
        except TransferUnauthenticated:
            raise
        except Exception as e:  # unreachable store, failed rendezvous
            raise TransferError(f"cannot open a pair with {address}: {e}") from e
