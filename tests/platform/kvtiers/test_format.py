"""The stored block format: a round trip is exact; corruption, truncation and another model's block are refused."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from ember_platform.kvtiers.format import (
    FORMAT_VERSION,
    MAGIC,
    CorruptBlockError,
    HeaderMismatchError,
    KVLayout,
    decode_block,
    encode_block,
)

LAYOUT = KVLayout(model="m1", dtype="float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
HASH = bytes(range(16))


def stored(layout: KVLayout = LAYOUT, block_hash: bytes = HASH) -> bytearray:
    payload = bytes(i % 251 for i in range(layout.block_bytes))
    return bytearray(b"".join(encode_block(layout, block_hash, payload)))


def test_round_trip_is_exact_and_payload_aligned() -> None:
    data = stored()
    payload = decode_block(LAYOUT, HASH, data)
    assert bytes(payload) == bytes(i % 251 for i in range(LAYOUT.block_bytes))
    assert (len(data) - 32 - payload.nbytes) % 64 == 0  # the payload starts 64-byte aligned in the blob
    assert data.startswith(MAGIC) and struct.unpack_from("<H", data, 8)[0] == FORMAT_VERSION


def test_block_bytes_match_the_layout() -> None:
    assert LAYOUT.block_shape == (2, 2, 2, 4, 8)
    assert LAYOUT.block_bytes == 2 * 2 * 2 * 4 * 8 * 4
    with pytest.raises(ValueError, match="bytes"):
        encode_block(LAYOUT, HASH, b"short")


@pytest.mark.parametrize("where", ["header", "payload", "checksum"])
def test_a_flipped_byte_is_caught(where: str) -> None:
    data = stored()
    index = {"header": 20, "payload": len(data) - 100, "checksum": len(data) - 1}[where]
    data[index] ^= 0x01
    with pytest.raises(CorruptBlockError):
        decode_block(LAYOUT, HASH, data)


@pytest.mark.parametrize("keep", [0, 5, 14, 300, -1])
def test_truncation_is_caught(keep: int) -> None:
    data = stored()
    with pytest.raises(CorruptBlockError):
        decode_block(LAYOUT, HASH, data[:keep])


@pytest.mark.parametrize("change", [
    {"model": "m2"}, {"dtype": "bfloat16"}, {"block_size": 8}, {"num_layers": 1}, {"num_kv_heads": 1},
    {"head_dim": 4}, {"tp_rank": 1}, {"tp_size": 2},
], ids=lambda c: next(iter(c)))
def test_another_model_or_layout_is_refused(change: dict[str, object]) -> None:
    other = dataclasses.replace(LAYOUT, **change)
    data = stored(other)
    with pytest.raises(HeaderMismatchError, match=next(iter(change))):
        decode_block(LAYOUT, HASH, data)
    assert other.namespace != LAYOUT.namespace  # and it is stored apart in the first place


def test_a_block_under_another_hash_is_refused() -> None:
    with pytest.raises(HeaderMismatchError, match="block_hash"):
        decode_block(LAYOUT, bytes(16), stored())


def test_another_format_version_is_refused() -> None:
    data = stored()
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 1)
    with pytest.raises(HeaderMismatchError, match="format version"):
        decode_block(LAYOUT, HASH, data)


def test_not_a_block_at_all() -> None:
    with pytest.raises(CorruptBlockError, match="magic"):
        decode_block(LAYOUT, HASH, bytearray(b"x" * 1000))


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float64"):
        KVLayout(model="m", dtype="float64", block_size=4, num_layers=1, num_kv_heads=1, head_dim=4)
