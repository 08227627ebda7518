"""Prefix hashing: the names of KV blocks, shared by the block manager, the prefix index and
the router. Pure Python (hashlib only): the router hashes a prompt without importing the block
manager, and an index mirrors a worker's cache from events without importing it either.

Hash scheme (see docs/prefix_hashing.md): ``h_i = sha256(seed || h_{i-1} || tokens_i)[:8]``
read as a little-endian u64, where ``seed = sha256("pdserve-kv-v1" || fingerprint || salt)``,
``h_{-1}`` is eight zero bytes and ``tokens_i`` are the block's token ids as little-endian
u32. Only complete blocks are hashed; a hash therefore names a whole token prefix, and a
different model or tenant salt yields a disjoint hash space.

Events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) describe every change to a block
manager's set of registered hashes, so an outside prefix index can mirror it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

_HASH_DOMAIN = b"pdserve-kv-v1"


def namespace_seed(model_fingerprint: str, cache_salt: str = "") -> bytes:
    """The per-(model, tenant) seed mixed into every block hash."""
    return hashlib.sha256(
        _HASH_DOMAIN + b"\0" + model_fingerprint.encode() + b"\0" + cache_salt.encode()
    ).digest()


def hash_block(seed: bytes, parent: int | None, token_ids: Sequence[int]) -> int:
    parent_bytes = b"\0" * 8 if parent is None else parent.to_bytes(8, "little")
    body = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return int.from_bytes(hashlib.sha256(seed + parent_bytes + body).digest()[:8], "little")


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, seed: bytes
) -> list[int]:
    """Append hashes for every complete block of `token_ids` not yet in `hashes` (in place)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(seed, parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one prefix became reusable. `parent_hash` precedes the first."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared


def reusable_prefix_hashes(
    token_ids: Sequence[int], block_size: int, model_fingerprint: str, cache_salt: str = ""
) -> list[int]:
    """The chained hashes of the prompt blocks a prefix hit could reuse: every complete block
    except one holding the prompt's last token (that token's pass must run to sample)."""
    seed = namespace_seed(model_fingerprint, cache_salt)
    usable = (len(token_ids) - 1) // block_size * block_size
    return extend_block_hashes([], token_ids[:usable], block_size, seed)
