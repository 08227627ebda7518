"""How a torch_dist pair comes to be: its store keys, its authentication, its control records.

`kv_transfer.transports.torch_dist` serves and sends frames; this module holds what both
of its sides agree on before the first frame:

* the decode worker's `TCPStore` (`host_store`), listening on the configured host only;
* the keys in it: ``next_pair`` (the counter a sender draws pair number ``i`` from),
  ``pair/<i>`` (the sender's registration, written with a compare-and-set so nobody's
  registration is ever overwritten: `claim_pair`), ``auth/<i>/...`` (the challenge),
  ``ctl/<i>/...`` (the names control records are sealed under), ``pg/<i>`` (the prefix of
  the pair's process group);
* which pairs the receiver serves (`PairWatch`): each number drawn is watched on its own, so
  registrations are served as they appear, in any order, and a number that nobody registers
  within the timeout (a sender that died between drawing and registering, or anyone else
  bumping the counter) is marked expired and skipped, holding up no later pair;
* the challenge (kv_transfer/auth.py): the receiver writes a fresh ``nonce`` with its control
  port (`challenge`), the sender answers with a ``proof`` (an HMAC under the shared secret,
  or empty without one) and checks the ``verdict`` the receiver writes: its own proof,
  ``open`` (it has no secret), ``refused: ...`` or ``busy: ...`` (`answer`). Both sides then
  derive the same per-pair key from the nonce (`pair_seal`); a refused pair never gets a
  group;
* the control connection's framing (`Records`: length-prefixed records on a socket) and the
  rendezvous of a pair's serving thread with its control connection (`PairSlot`);
* the two-rank process group itself (`make_pair_group`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.auth import RecordSeal
from kv_transfer.wire import TransferError, TransferUnauthenticated

VERDICT_OPEN = "open"  # the receiver has no secret: the pair is not authenticated
VERDICT_REFUSED = "refused: "
VERDICT_BUSY = "busy: "  # refused before any challenge: too many pairs authenticating
NEXT_PAIR = "next_pair"  # the counter senders draw pair numbers from
PAIR_EXPIRED = "expired"  # written under a drawn number nobody registered in time
MAX_WATCHED = 64  # drawn numbers awaiting their registration, watched at once
_MAX_JUMP = 1 << 20  # a counter further ahead than this between two polls was tampered with
_CLAIM_TRIES = 8
_POLL_S = 0.01
_ABSENT = "\0absent"  # `peek`'s marker of a key that is not set
MAX_RECORD_BYTES = 1 << 24  # a control record (header or ack) larger than this is garbage
_LEN = struct.Struct("!I")


def td(seconds: float) -> datetime.timedelta:
    """`seconds` as the timedelta c10d's timeouts take."""
    return datetime.timedelta(seconds=seconds)


class PairGroup(Protocol):
    """The point-to-point part of a backend process group (gloo or NCCL)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


def make_pair_group(
    store: dist.Store, rank: int, device: torch.device, timeout_s: float
) -> PairGroup:
    """A two-rank group without init_process_group: NCCL on CUDA, gloo on CPU."""
    if device.type == "cuda":  # pragma: no cover - needs two GPUs (NCCL cannot pair one)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td(timeout_s)
        return cast(PairGroup, dist.ProcessGroupNCCL(store, rank, 2, opts))
    return cast(PairGroup, dist.ProcessGroupGloo(store, rank, 2, td(timeout_s)))


def ctl_key(pair: int, what: str) -> str:
    """The name a pair's control record is sealed under (``frame/<n>``, ``ack/<n>``)."""
    return f"ctl/{pair}/{what}"


def auth_key(pair: int, what: str) -> str:
    """A store key of the pair's challenge (``nonce``, ``proof``, ``verdict``)."""
    return f"auth/{pair}/{what}"


def pair_key(pair: int) -> str:
    """The store key a sender registers pair `pair` under."""
    return f"pair/{pair}"


def listen_socket(host: str) -> socket.socket:
    """A listening TCP socket on a free port of `host` (that address only, not every one)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, 0), family=family, backlog=128)


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The receiver's store, listening on `host` only. c10d's own server listens on every
    interface whatever `host_name` says, so it is handed a socket bound here (it owns the
    descriptor from then on, and closes it with the store)."""
    sock = listen_socket(host)
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(
            host,
            port,
            None,
            True,
            timeout=td(timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except Exception:
        os.close(fd)
        raise


def own_connection(store: dist.TCPStore) -> dist.Store:
    """A new client connection to `store`'s server (c10d runs one request at a time per
    connection, and drops a connection whose request failed)."""
    return cast(dist.Store, store.clone())  # type: ignore[attr-defined]  # not in the stubs


def claim_pair(store: dist.Store, sender_id: str) -> int:
    """Sender side: draw a pair number and register it (``pair/<n>``). The registration is a
    compare-and-set, so a number the receiver already gave up on, or that anyone else wrote,
    is never taken over; the sender draws the next one instead."""
    for _ in range(_CLAIM_TRIES):
        pair = int(store.add(NEXT_PAIR, 1)) - 1
        mine = f"{secrets.token_hex(8)}:{sender_id}"  # unique: only this sender wrote it
        if pair >= 0 and store.compare_set(pair_key(pair), "", mine) == mine.encode():
            return pair
    raise TransferError(f"no pair number of its own after {_CLAIM_TRIES} draws")


class PairWatch:
    """Receiver side: which drawn pair numbers were registered, in any order.

    Every number the counter handed out since the last poll is watched on its own until its
    registration appears (the pair is served) or for `timeout_s` (it is marked expired with a
    compare-and-set, so a registration racing the expiry is served, and a later one draws
    anew): a number drawn by a sender that died, or by anyone else, holds up nobody. A
    counter set back, deleted, made garbage or pushed far ahead is put back where it was;
    at most MAX_WATCHED numbers are watched at once (older ones are skipped).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.seen = 0  # numbers below this were handed out
        self.skipped = 0  # numbers given up on: never registered in time
        self._deadlines: dict[int, float] = {}

    def poll(self, store: dist.Store) -> list[tuple[int, str]]:
        """The pairs registered since the last poll, as (pair, sender id)."""
        n = self._counter(store)
        now = time.monotonic()
        low = max(self.seen, n - MAX_WATCHED)
        self.skipped += low - self.seen
        self._deadlines.update((i, now + self.timeout_s) for i in range(low, n))
        self.seen = n
        found = []
        for i in sorted(self._deadlines):
            value = peek(store, pair_key(i))
            if value is None and (now >= self._deadlines[i] or i < n - MAX_WATCHED):
                value = store.compare_set(pair_key(i), "", PAIR_EXPIRED)
            if value is None:
                continue
            del self._deadlines[i]
            if value == PAIR_EXPIRED.encode():
                self.skipped += 1
            else:  # "<token>:<sender id>"
                found.append((i, value.decode(errors="replace").partition(":")[2]))
        return found

    def _counter(self, store: dist.Store) -> int:
        """The counter's value, put back to `seen` when it is not a plausible one (never
        read with `add`: c10d drops a client whose `add` meets a value that is no number)."""
        raw = peek(store, NEXT_PAIR)
        try:
            n = 0 if raw is None else int(raw)
        except ValueError:
            n = -1
        if not self.seen <= n <= self.seen + _MAX_JUMP:
            store.set(NEXT_PAIR, str(self.seen))
            return self.seen
        return n


def peek(store: dist.Store, key: str) -> bytes | None:
    """`key`'s value, or None when it is not set, without blocking (a `get` of a missing key
    waits out the store's timeout; `check` then `get` races a delete): a compare-and-set
    whose expected and desired values are the same absent marker changes nothing."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


def wait_key(store: dist.Store, key: str, timeout_s: float, stop: threading.Event) -> bool:
    """Whether `key` appeared within `timeout_s` (False at once when `stop` is set). Polls:
    a c10d `wait` cannot be woken by closing, and logs every time it times out."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if stop.is_set() or time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


class Records:
    """Length-prefixed records on a socket. `read` keeps a partial record across timeouts,
    so a timeout (the stall check) never loses the stream's framing."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def write(self, record: bytes) -> None:
        self.sock.sendall(_LEN.pack(len(record)) + record)

    def read(self, timeout_s: float | None) -> bytes | None:
        """The next record; None on timeout. Raises EOFError when the peer closed."""
        self.sock.settimeout(timeout_s)
        while True:
            if len(self._buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(self._buf)
                if n > MAX_RECORD_BYTES:
                    raise EOFError(f"control record of {n} bytes")
                if len(self._buf) >= _LEN.size + n:
                    record = bytes(self._buf[_LEN.size : _LEN.size + n])
                    del self._buf[: _LEN.size + n]
                    return record
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                return None
            if not chunk:
                raise EOFError("control connection closed")
            self._buf += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@dataclass
class PairSlot:
    """Rendezvous of a pair's thread (after authentication) and its control connection."""

    sealed: threading.Event = field(default_factory=threading.Event)
    connected: threading.Event = field(default_factory=threading.Event)
    records: Records | None = None


def pair_seal(secret: str | None, nonce: str, pair: int, sender: str) -> RecordSeal:
    """The key both sides derive for the pair's control records (None without a secret)."""
    if secret is None:
        return RecordSeal(None)
    return RecordSeal(auth.mac(secret, "torch_dist/records", nonce, str(pair), sender))


class PairRefused(Exception):
    """The receiver refuses the pair's sender; the message is the reason it will publish."""


def challenge(
    store: dist.Store,
    pair: int,
    sender: str,
    secret: str | None,
    timeout_s: float,
    ctl_port: int,
    stop: threading.Event,
) -> RecordSeal:
    """Receiver side: challenge the pair's sender; the seal of its control records.

    The nonce carries the receiver's control port (``<nonce>@<port>``): with a secret, both
    proofs cover it, so a sender never connects to a port someone else wrote. Raises
    PairRefused when the sender does not answer within `timeout_s` (or `stop` is set) or
    answers wrongly; the caller then writes the refusal verdict (nothing is written for it
    here), so no group is built for the pair. Without a secret every answer is accepted and
    the verdict says ``open``.
    """
    nonce = f"{auth.new_nonce()}@{ctl_port}"
    store.set(auth_key(pair, "nonce"), nonce)
    if not wait_key(store, auth_key(pair, "proof"), timeout_s, stop):
        why = "the endpoint is closing" if stop.is_set() else f"no answer within {timeout_s} s"
        raise PairRefused(f"{why} (challenge)")
    presented = store.get(auth_key(pair, "proof"))
    store.delete_key(auth_key(pair, "proof"))
    store.delete_key(auth_key(pair, "nonce"))
    if secret is None:
        store.set(auth_key(pair, "verdict"), VERDICT_OPEN)
        return RecordSeal(None)
    if not auth.verify(secret, presented, "torch_dist/sender", nonce, str(pair), sender):
        raise PairRefused("authentication failed (no or wrong shared secret)")
    accept = auth.proof(secret, "torch_dist/receiver", nonce, str(pair), sender)
    store.set(auth_key(pair, "verdict"), accept)
    return pair_seal(secret, nonce, pair, sender)


def refuse_busy(store: dist.Store, pair: int, why: str) -> None:
    """Receiver side: turn a pair away before any challenge (its sender gets a TransferError,
    not an authentication failure): the verdict first, then the nonce its sender waits for."""
    store.set(auth_key(pair, "verdict"), VERDICT_BUSY + why)
    store.set(auth_key(pair, "nonce"), "-")


def answer(
    store: dist.Store, pair: int, sender_id: str, secret: str | None, address: str
) -> tuple[RecordSeal, int]:
    """Sender side: answer the receiver's challenge and check its verdict; the seal of the
    pair's control records and the receiver's control port. Runs before any group exists,
    so a refused pair never builds one. Raises TransferUnauthenticated when the receiver
    refused the pair, or when the two sides do not hold the same secret (one has none, or
    they differ); TransferError when it was turned away busy."""
    nonce = store.get(auth_key(pair, "nonce")).decode(errors="replace")  # blocks until set
    parts = (nonce, str(pair), sender_id)
    proof = "" if secret is None else auth.proof(secret, "torch_dist/sender", *parts)
    store.set(auth_key(pair, "proof"), proof)
    verdict = store.get(auth_key(pair, "verdict")).decode(errors="replace")
    store.delete_key(auth_key(pair, "verdict"))
    if verdict.startswith(VERDICT_BUSY):
        raise TransferError(f"{address} turned the pair away: {verdict[len(VERDICT_BUSY) :]}")
    if verdict.startswith(VERDICT_REFUSED):
        raise TransferUnauthenticated(
            f"{address} refused the pair: {verdict[len(VERDICT_REFUSED) :]}"
        )
    if secret is None:
        if verdict != VERDICT_OPEN:
            raise TransferUnauthenticated(
                f"{address} requires authentication; this sender has no shared secret"
            )
    elif not auth.verify(secret, verdict, "torch_dist/receiver", *parts):
        raise TransferUnauthenticated(
            f"{address} failed authentication (it has no or a different shared secret)"
        )
    port = nonce.rpartition("@")[2]
    if not port.isdigit():
        raise TransferError(f"{address} published no control port for pair {pair}")
    return pair_seal(secret, nonce, pair, sender_id), int(port)
