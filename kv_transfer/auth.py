"""Channel authentication: peers prove they hold the cluster's shared secret, never send it.

With `TransferConfig.shared_secret` (or env PDSERVE_KV_SECRET) set, a receiver accepts no
frame from a channel until the sender answered a challenge: HMAC-SHA256 under the secret of a
nonce the *receiver* chose, bound to the channel and the sender's id, compared in constant
time. The receiver answers with a proof of its own, so a sender with a secret talks only to
receivers holding the same one. Which nonce:

* torch_dist: a fresh random nonce per pair, written into the receiver's store;
* grpc: the ticket's transfer id (random, chosen by the receiver at reservation); the stream
  may then carry frames of that transfer only.

torch_dist also seals its control connection's hello and every record on it (frame headers,
acks) with a per-pair key, so a process that reaches the plaintext control port cannot
inject frames into an authenticated pair.
What this does not give: confidentiality, or integrity of payload bytes on the gloo/NCCL
connections. Network policy (k8s/README.md) stays the first line; see docs/lifecycle.md.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SECRET_ENV = "PDSERVE_KV_SECRET"
MIN_SECRET_LEN = 16
TAG_BYTES = 32  # HMAC-SHA256
_DOMAIN = "pdserve-kv-auth-v1"


def check_secret(secret: str, where: str) -> None:
    """Reject a secret too short to be one (an empty env var must not mean 'no auth')."""
    if len(secret) < MIN_SECRET_LEN:
        raise ValueError(f"{where}: the shared secret must be at least {MIN_SECRET_LEN} characters")


def new_nonce() -> str:
    return secrets.token_hex(16)


def mac(secret: str, *parts: str) -> bytes:
    """HMAC-SHA256 under `secret` of the length-prefixed parts (no two part lists collide)."""
    msg = "".join(f"{len(p)}:{p}" for p in (_DOMAIN, *parts))
    return hmac.new(secret.encode(), msg.encode(), hashlib.sha256).digest()


def proof(secret: str, *parts: str) -> str:
    """`mac` as hex: what goes into a store value or call metadata."""
    return mac(secret, *parts).hex()


def verify(secret: str, presented: str | bytes, *parts: str) -> bool:
    """Constant-time check of a presented `proof`."""
    if isinstance(presented, str):
        presented = presented.encode("ascii", "replace")
    return hmac.compare_digest(proof(secret, *parts).encode(), presented)


def same_secret(mine: str | None, theirs: str | None) -> bool:
    """Both without a secret, or both with the same one (in-process peers)."""
    if mine is None or theirs is None:
        return mine is theirs
    return hmac.compare_digest(mine.encode(), theirs.encode())


class RecordSeal:
    """Tags store records with a per-pair key, bound to the key they are stored under.

    Without a key (no secret on this pair) the tag is zeros and `open` does not check it, so
    both kinds of pair share one record format: TAG_BYTES of tag, then the body.
    """

    def __init__(self, key: bytes | None) -> None:
        self._key = key

    def _tag(self, name: str, body: bytes) -> bytes:
        if self._key is None:
            return bytes(TAG_BYTES)
        return hmac.new(self._key, name.encode() + b"\0" + body, hashlib.sha256).digest()

    def seal(self, name: str, body: bytes) -> bytes:
        return self._tag(name, body) + body

    def open(self, name: str, record: bytes) -> bytes | None:
        """The body, or None when the record is short or (with a key) its tag is wrong."""
        if len(record) < TAG_BYTES:
            return None
        tag, body = record[:TAG_BYTES], record[TAG_BYTES:]
        if self._key is not None and not hmac.compare_digest(tag, self._tag(name, body)):
            return None
        return body
