"""KV cache tiers below the device — CPU RAM, local disk, S3 — keyed by the engine's block-hash chain, so that a
prefix evicted from the device, or computed by another replica, is loaded instead of recomputed.

Turn them on with the engine option `kv_tiers` (a KVTierConfig or a mapping of its fields):

    LLM(path, kv_tiers={"cpu_gb": 2, "disk_dir": "/var/cache/ember/kv", "s3_url": "s3://bucket/kv"})

The engine's KV cache manager drives the store (write-through on caching, fetch on a device miss); `seed`
loads the hottest prefixes into a fresh engine; `KVTierStore.add_listener` reports tier membership for routing.
"""

from __future__ import annotations

from ember_platform.kvtiers.config import KVTierConfig
from ember_platform.kvtiers.format import (
    FORMAT_VERSION,
    BlockFormatError,
    CorruptBlockError,
    HeaderMismatchError,
    KVLayout,
    decode_block,
    encode_block,
)
from ember_platform.kvtiers.seeding import seed
from ember_platform.kvtiers.store import TIERS, FetchedBlock, KVTierStore, TierEvent

__all__ = ["FORMAT_VERSION", "TIERS", "BlockFormatError", "CorruptBlockError", "FetchedBlock", "HeaderMismatchError",
           "KVLayout", "KVTierConfig", "KVTierStore", "TierEvent", "decode_block", "encode_block", "seed"]
