"""The stored KV block format, version 1: which model and layout a block belongs to, its payload, and a
checksum — so that a block is never loaded into the wrong model, and corruption or truncation is caught.

    MAGIC (8 bytes "EMBERKV\\0") | format version (u16 LE) | header length (u32 LE)
    | header (UTF-8 JSON, sorted keys, space-padded so the payload starts 64-byte aligned) | payload
    | BLAKE2b-256 of everything before it (32 bytes)

Header: `format`, `model` (the model's identity: a digest of its weights and quantization), `dtype`,
`block_size`, `num_layers`, `num_kv_heads`, `head_dim`, `tp_rank`, `tp_size`, `hash_version` (the block
hash spec, engine/block_hash.py), `block_hash` (hex) and `payload_bytes`.

Payload: one block of every layer, `[num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]` in `dtype`,
C order, little-endian: the engine's HND cache layout (engine/attention.py) with the block index taken out.

Torch-free on purpose: a tool can inspect or verify a store without the engine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

from ember_platform.engine.block_hash import BLOCK_HASH_VERSION, BlockHash

MAGIC = b"EMBERKV\x00"
FORMAT_VERSION = 1
CHECKSUM_BYTES = 32
_PREFIX = struct.Struct("<8sHI")  # magic, format version, header length
_MAX_HEADER = 1 << 16
_ALIGN = 64
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}


class BlockFormatError(ValueError):
    """A stored block that must not be loaded."""


class CorruptBlockError(BlockFormatError):
    """Truncated, or its checksum does not match: the bytes changed since they were written."""


class HeaderMismatchError(BlockFormatError):
    """Intact, but written for another model, layout, rank or format version."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a KV block's bytes mean: the model they came from and the shape they have."""

    model: str  # the model's identity (kvtiers/identity.py)
    dtype: str  # torch dtype name without "torch."
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KV dtype {self.dtype!r} has no stored format; known: {', '.join(DTYPE_BYTES)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """[layers, K/V, KV heads, block size, head dim]."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.block_shape:
            n *= d
        return n

    @property
    def namespace(self) -> str:
        """A short digest of the layout: stores keep each layout's blocks apart under it, so two models sharing
        a bucket or a directory never even look at each other's blocks (the header check stays as the proof)."""
        text = json.dumps({**asdict(self), "format": FORMAT_VERSION, "hash_version": BLOCK_HASH_VERSION},
                          sort_keys=True)
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def header(self, block_hash: BlockHash) -> dict[str, object]:
        return {**asdict(self), "format": FORMAT_VERSION, "hash_version": BLOCK_HASH_VERSION,
                "block_hash": block_hash.hex(), "payload_bytes": self.block_bytes}


def encode_block(layout: KVLayout, block_hash: BlockHash,
                 payload: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
    """The stored form of one block as chunks to write one after the other (the payload is not copied)."""
    view = memoryview(payload).cast("B")
    if view.nbytes != layout.block_bytes:
        raise ValueError(f"a block of this layout has {layout.block_bytes} bytes, got {view.nbytes}")
    header = _header_bytes(layout, block_hash)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header))
    digest = hashlib.blake2b(prefix, digest_size=CHECKSUM_BYTES)
    digest.update(header)
    digest.update(view)
    return [prefix, header, view, digest.digest()]


def _header_bytes(layout: KVLayout, block_hash: BlockHash) -> bytes:
    header = json.dumps(layout.header(block_hash), sort_keys=True, separators=(",", ":")).encode()
    # Aligned payloads: a reader's tensor view of a freshly read buffer then has aligned elements.
    return header + b" " * (-(_PREFIX.size + len(header)) % _ALIGN)


def decode_block(layout: KVLayout, block_hash: BlockHash, data: bytes | bytearray | memoryview) -> memoryview:
    """The payload of a stored block, checked: raises CorruptBlockError or HeaderMismatchError."""
    view = memoryview(data).cast("B")
    if view.nbytes < _PREFIX.size + CHECKSUM_BYTES:
        raise CorruptBlockError(f"truncated: {view.nbytes} bytes")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlockError("not an Ember KV block (bad magic)")
    if version != FORMAT_VERSION:
        # Checked before the checksum: a future version may checksum differently.
        raise HeaderMismatchError(f"format version {version}, this engine reads {FORMAT_VERSION}")
    body_end = view.nbytes - CHECKSUM_BYTES
    if header_len > _MAX_HEADER or _PREFIX.size + header_len > body_end:
        raise CorruptBlockError(f"truncated or bad header length {header_len}")
    digest = hashlib.blake2b(view[:body_end], digest_size=CHECKSUM_BYTES).digest()
    if digest != bytes(view[body_end:]):
        raise CorruptBlockError("checksum mismatch")
    try:
        header = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + header_len]))
    except ValueError as e:  # intact bytes that were never a valid header: a writer bug, treat as corrupt
        raise CorruptBlockError(f"unreadable header ({e})") from None
    expected = layout.header(block_hash)
    wrong = [k for k in expected if header.get(k) != expected[k]]
    if wrong:
        detail = ", ".join(f"{k}={header.get(k)!r} (expected {expected[k]!r})" for k in wrong)
        raise HeaderMismatchError(f"written for another model or layout: {detail}")
    payload = view[_PREFIX.size + header_len:body_end]
    if payload.nbytes != layout.block_bytes:
        raise CorruptBlockError(f"payload of {payload.nbytes} bytes, expected {layout.block_bytes}")
    return payload
