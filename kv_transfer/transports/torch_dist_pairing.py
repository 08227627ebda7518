"""How a torch_dist pair comes to be: its store keys, its authentication, its control records.

`kv_transfer.transports.torch_dist` serves and sends frames; this module holds what both
of its sides agree on before the first frame:

* the keys in the decode worker's `TCPStore`: ``pair/<i>`` (a sender registers pair ``i``),
  ``auth/<i>/...`` (the challenge), ``ctl/<i>/...`` (the names control records are sealed
  under), ``pg/<i>`` (the prefix of the pair's process group);
* the challenge (kv_transfer/auth.py): the receiver writes a fresh ``nonce``
  (`challenge`), the sender answers with a ``proof`` (an HMAC under the shared secret, or
  empty without one) and checks the ``verdict`` the receiver writes: its own proof,
  ``open`` (it has no secret) or ``refused: ...`` (`answer`). Both sides then derive the
  same per-pair key from the nonce (`pair_seal`); a refused pair never gets a group;
* the control connection's framing (`Records`: length-prefixed records on a socket) and the
  rendezvous of a pair's serving thread with its control connection (`PairSlot`);
* the two-rank process group itself (`make_pair_group`).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.auth import RecordSeal
from kv_transfer.wire import TransferUnauthenticated

VERDICT_OPEN = "open"  # the receiver has no secret: the pair is not authenticated
VERDICT_REFUSED = "refused: "
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
    store: dist.Store, pair: int, sender: str, secret: str | None, timeout_s: float
) -> RecordSeal:
    """Receiver side: challenge the pair's sender; the seal of its control records.

    Raises PairRefused when the sender does not answer within `timeout_s` or answers
    wrongly; the caller then writes the refusal verdict (nothing is written for it here),
    so no group is built for the pair. Without a secret every answer is accepted and the
    verdict says ``open``.
    """
    nonce = auth.new_nonce()
    store.set(auth_key(pair, "nonce"), nonce)
    try:
        store.wait([auth_key(pair, "proof")], td(timeout_s))
        presented = store.get(auth_key(pair, "proof"))
        store.delete_key(auth_key(pair, "proof"))
    except Exception as e:
        raise PairRefused(f"no answer to the challenge within {timeout_s} s") from e
    store.delete_key(auth_key(pair, "nonce"))
    if secret is None:
        store.set(auth_key(pair, "verdict"), VERDICT_OPEN)
        return RecordSeal(None)
    if not auth.verify(secret, presented, "torch_dist/sender", nonce, str(pair), sender):
        raise PairRefused("authentication failed (no or wrong shared secret)")
    accept = auth.proof(secret, "torch_dist/receiver", nonce, str(pair), sender)
    store.set(auth_key(pair, "verdict"), accept)
    return pair_seal(secret, nonce, pair, sender)


def answer(
    store: dist.Store, pair: int, sender_id: str, secret: str | None, address: str
) -> RecordSeal:
    """Sender side: answer the receiver's challenge and check its verdict; the seal of the
    pair's control records. Runs before any group exists, so a refused pair never builds
    one. Raises TransferUnauthenticated when the receiver refused the pair, or when the two
    sides do not hold the same secret (one has none, or they differ)."""
    nonce = store.get(auth_key(pair, "nonce")).decode()  # blocks until it is written
    parts = (nonce, str(pair), sender_id)
    proof = "" if secret is None else auth.proof(secret, "torch_dist/sender", *parts)
    store.set(auth_key(pair, "proof"), proof)
    verdict = store.get(auth_key(pair, "verdict")).decode(errors="replace")
    store.delete_key(auth_key(pair, "verdict"))
    if verdict.startswith(VERDICT_REFUSED):
        raise TransferUnauthenticated(
            f"{address} refused the pair: {verdict[len(VERDICT_REFUSED) :]}"
        )
    if secret is None:
        if verdict != VERDICT_OPEN:
            raise TransferUnauthenticated(
                f"{address} requires authentication; this sender has no shared secret"
            )
        return RecordSeal(None)
    if not auth.verify(secret, verdict, "torch_dist/receiver", *parts):
        raise TransferUnauthenticated(
            f"{address} failed authentication (it has no or a different shared secret)"
        )
    return pair_seal(secret, nonce, pair, sender_id)
