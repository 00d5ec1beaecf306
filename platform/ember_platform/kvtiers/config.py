"""`kv_tiers=...`: which tiers below the device a replica keeps KV blocks in, and how big each is."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class KVTierConfig:
    """Tiers below the device pool, each an LRU cache of its own capacity; a tier is on when configured.

    `LLM(path, kv_tiers={"cpu_gb": 2, "disk_dir": "/var/cache/ember/kv", "s3_url": "s3://bucket/kv"})`.
    """

    cpu_gb: float = 4.0  # host-RAM tier (pinned on CUDA); 0 turns it off
    disk_dir: str | None = None  # local-disk tier: a directory (blocks go in a per-model subdirectory)
    disk_gb: float = 32.0
    s3_url: str | None = None  # S3 tier, shared across replicas: s3://BUCKET[/PREFIX]
    s3_endpoint_url: str | None = None  # default: $AWS_ENDPOINT_URL, else AWS
    s3_gb: float | None = None  # what this replica's own uploads may occupy; None: leave expiry to the bucket
    # S3 sits on the request path: a request waits for its fetch, so a dead endpoint must fail fast.
    s3_timeout_s: float = 1.0  # connect and read timeout of one request, no retries
    s3_breaker_failures: int = 3  # consecutive failures that open the circuit breaker ...
    s3_breaker_cooldown_s: float = 30.0  # ... which skips S3 this long before one probe request
    s3_fetch_threads: int = 8  # parallel GETs for one prefix's blocks
    # Read disk and S3 blocks in the background into the CPU tier while the step loop keeps running other
    # requests; the request waits for them, not the whole batch. Needs the CPU tier (else reads are inline).
    async_loads: bool = True
    hot_publish_s: float = 60.0  # how often this replica uploads its hottest prefixes (for seeding others)
    # At start, before the first request, load this many of the hottest prefixes other replicas published to S3
    # into the device pool (a fresh replica's first requests then hit instead of recomputing); 0: don't.
    seed_prefixes: int = 0
    max_pending_writes: int = 256  # blocks queued per lower tier; more are dropped (and counted)
    model_id: str | None = None  # the model's identity in stored blocks; default: a digest of its weights
    replica_id: str | None = None  # names this replica's hot-prefix list; default: host and pid

    def __post_init__(self) -> None:
        for name in ("cpu_gb", "disk_gb", "s3_timeout_s", "s3_breaker_cooldown_s", "hot_publish_s", "seed_prefixes"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv_tiers.{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("s3_breaker_failures", "s3_fetch_threads", "max_pending_writes"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_tiers.{name}: must be >= 1, got {getattr(self, name)}")
        if self.s3_gb is not None and self.s3_gb <= 0:
            raise ValueError(f"kv_tiers.s3_gb: must be > 0 (or unset), got {self.s3_gb}")
        if self.s3_url is not None and not (self.s3_url.startswith("s3://") and self.s3_url[5:].strip("/")):
            raise ValueError(f"kv_tiers.s3_url: expected s3://BUCKET[/PREFIX], got {self.s3_url!r}")
        if self.s3_endpoint_url is None and self.s3_url is not None:
            self.s3_endpoint_url = os.environ.get("AWS_ENDPOINT_URL") or None

    @property
    def any_tier(self) -> bool:
        return bool(self.cpu_gb > 0 or self.disk_dir or self.s3_url)

    @classmethod
    def from_value(cls, value: KVTierConfig | Mapping[str, Any] | None) -> KVTierConfig | None:
        """The `kv_tiers` engine option: a KVTierConfig, a mapping of its fields, or None (tiers off)."""
        if value is None or isinstance(value, KVTierConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"kv_tiers: expected a mapping of options or a KVTierConfig, got {type(value).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in valid]
        if unknown:
            hints = [difflib.get_close_matches(k, valid, n=1) for k in unknown]
            detail = "; ".join(f"'{k}'" + (f" (did you mean '{h[0]}'?)" if h else "")
                               for k, h in zip(unknown, hints, strict=True))
            raise TypeError(f"kv_tiers: unknown option {detail}; valid options: {', '.join(valid)}")
        return cls(**value)
