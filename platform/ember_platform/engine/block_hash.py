"""The KV block hash spec, version 1 — shared by the engine, the router and the KV tiers.

A *full* block of `block_size` tokens is identified by a hash chained from the block before
it, so equal hashes mean equal prefixes, not just equal blocks:

    hash(block i) = BLAKE2b-128(parent || tokens || extra, person=b"ember-kv-v1")

* `parent`: the previous block's 16-byte hash; for block 0, `ROOT_PARENT` (the same BLAKE2b of
  the empty string with the same person string: a fixed seed, identical in every process).
* `tokens`: the block's token ids, each a little-endian uint32.
* `extra`: what else changes the KV for the same tokens, encoded as `b"\\x00" + key + b"=" +
  value` for each present key in this order: `lora` (adapter name), `salt` (a per-tenant cache
  salt). Absent keys add nothing, so a plain request's hashes depend on tokens alone.

Python's `hash()` is salted per process, so it can never be used here. The spec is pure Python
(no torch) so that a gateway can compute a request's block hashes to route it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_HASH_VERSION = 1
_PERSON = b"ember-kv-v1"
ROOT_PARENT = hashlib.blake2b(b"", digest_size=16, person=_PERSON).digest()

BlockHash = bytes  # 16 bytes


def extra_keys(lora: str | None = None, salt: str | None = None) -> bytes:
    out = b""
    if lora:
        out += b"\x00lora=" + lora.encode()
    if salt:
        out += b"\x00salt=" + salt.encode()
    return out


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    data = array("I", tokens)
    if data.itemsize != 4:  # pragma: no cover - "I" is 4 bytes on every platform Ember runs on
        raise RuntimeError("uint32 array expected")
    if array("I", [1]).tobytes()[0] != 1:  # big-endian host: normalize to little-endian
        data.byteswap()
    return hashlib.blake2b(parent + data.tobytes() + extra, digest_size=16, person=_PERSON).digest()


def hash_blocks(tokens: Sequence[int], block_size: int, extra: bytes = b"",
                parent: BlockHash = ROOT_PARENT, start: int = 0) -> list[BlockHash]:
    """Hashes of every full block of `tokens[start:]`, chained from `parent`."""
    hashes = []
    for i in range(start, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[i:i + block_size], extra)
        hashes.append(parent)
    return hashes
