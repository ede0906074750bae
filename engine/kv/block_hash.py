"""Chained block hashes for the prefix cache and for prefix-affinity routing.

A full block of `block_size` tokens is named by `hash(parent hash, its tokens, extra key)`,
so a block hash stands for the whole prefix that ends with that block: equal tokens after a
different prefix give a different hash. The hash is an 8-byte blake2b digest of packed
integers, so it is the same in every process (unlike Python's salted `hash()` of a str) and
the ingress can compute it without torch to route a prompt to the replica that holds it.

`extra_key` separates caches that must never share blocks (different weights, adapters);
`model_key(name)` derives one from a model name.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_U64 = (1 << 64) - 1
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def hash_block(parent_hash: int | None, tokens: Sequence[int], extra_key: int) -> int:
    """The 64-bit hash of one block, chained on the hash of the block before it (or None).

    Token ids are packed as signed 64-bit ints, keys as unsigned 64-bit (reduced mod 2**64).
    """
    head = _NO_PARENT if parent_hash is None else _HAS_PARENT
    keys = struct.pack("<QQ", (parent_hash or 0) & _U64, extra_key & _U64)
    body = struct.pack(f"<{len(tokens)}q", *tokens)
    return _digest64(head + keys + body)


def model_key(name: str) -> int:
    """A stable 64-bit `extra_key` for a model name (or any other string)."""
    return _digest64(name.encode("utf-8"))


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, extra_key: int) -> list[int]:
    """Chained hashes of every full block of `token_ids`; a trailing partial block is skipped."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes
