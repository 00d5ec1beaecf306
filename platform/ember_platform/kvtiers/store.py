"""KVTierStore: one engine's KV blocks below the device — CPU RAM, local disk, S3 — keyed by the block-hash chain.

Write-through: each block the prefix cache registers is copied once from the device into the CPU tier (on the
engine's thread: the device block may be reused by the very next step) and queued for the disk and S3 writers,
so evicting a block from the device later costs nothing. A prefix that misses on the device is looked up tier by
tier, block by block from its first missing block (CPU, then disk, then S3 for the rest in parallel); what is
found is loaded into fresh device blocks instead of being recomputed, and promoted into the upper tiers.

Reads from disk and S3 take milliseconds to seconds, so with a CPU tier they happen in the background: `stage`
starts reading a request's missing run into the CPU tier on a stager thread and says "not yet"; the scheduler
leaves that request waiting and runs the others, and once the run is staged, `fetch` finds it in host RAM.

Thread model: `save`, `stage`, `fetch`, `load` and `note_prefix` run on the engine's thread (the KV cache manager
calls them); the writers and the stager run on their own threads; membership listeners are called from whichever
thread changed a tier (engine thread or stager for CPU, writer threads for disk and S3).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember_platform.engine.attention import KVCache
from ember_platform.engine.block_hash import BlockHash
from ember_platform.kvtiers.config import KVTierConfig
from ember_platform.kvtiers.format import (
    DTYPE_BYTES,
    CorruptBlockError,
    HeaderMismatchError,
    KVLayout,
    decode_block,
    encode_block,
)
from ember_platform.kvtiers.hot import HotPrefixes, merge_hot_lists
from ember_platform.kvtiers.s3 import CircuitBreaker, S3Tier, S3Unavailable
from ember_platform.kvtiers.tiers import CpuTier, DiskTier
from ember_platform.kvtiers.writer import AsyncWriter, WriteJob

log = logging.getLogger("ember.kvtiers")

TIERS = ("cpu", "disk", "s3")  # fastest first: the order of lookups, and of credit for routing
HOT_FOLDER = "hot"
_S3_MISS_TTL_S = 2.0  # a waiting request is looked up again each step: don't ask S3 again each time
_S3_MISS_MEMORY = 4096
_MAX_STAGED = 256


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Blocks that entered (`stored`) or left (`removed`) one tier: what the routing tables consume."""

    tier: str
    stored: list[BlockHash]
    removed: list[BlockHash]


@dataclass(slots=True)
class FetchedBlock:
    """A block found below the device, on the host, waiting to be copied into a device block."""

    block_hash: BlockHash
    tier: str  # where it was found
    data: torch.Tensor  # [*layout.block_shape]
    slot: int | None  # its CPU-tier slot, pinned until `load` or `release`


TierListener = Callable[[TierEvent], None]


def check_tierable(kv_caches: Sequence[KVCache], block_size: int) -> None:
    """ValueError unless the caches are what tiers store: per layer K and V only (no scales), in the default
    "HND" layout `[num_blocks, num_kv_heads, block_size, head_dim]`, in a dtype the block format knows. A quantized
    KV cache (`[runtime] kv_cache_dtype` int8 / fp8) is refused: its per-token scales are not carried yet."""
    first = kv_caches[0] if kv_caches else ()
    if len(first) != 2:
        raise ValueError(f"not supported yet: KV tiers with a quantized KV cache (each layer holds {len(first)} "
                         "tensors: K, V and their scales, which tiers do not carry); set [runtime] kv_cache_dtype = "
                         "\"auto\" or turn the KV tiers off")
    k_cache = first[0]
    if k_cache.dim() != 4 or k_cache.shape[2] != block_size or first[1].shape != k_cache.shape:
        raise ValueError(f"not supported yet: KV tiers with a KV cache of shape {tuple(k_cache.shape)}: tiers store "
                         f"the default layout [num_blocks, num_kv_heads, block_size={block_size}, head_dim] only")
    dtype = str(k_cache.dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"not supported yet: KV tiers with a {dtype} KV cache (stored formats: "
                         f"{', '.join(DTYPE_BYTES)})")


class KVTierStore:
    """The lower KV tiers of one engine; implements the KV cache manager's `KVTierConnector`."""

    def __init__(self, config: KVTierConfig, layout: KVLayout, kv_caches: Sequence[KVCache],
                 device: torch.device | str = "cpu") -> None:
        if len(kv_caches) != layout.num_layers:
            raise ValueError(f"layout has {layout.num_layers} layers, the KV cache {len(kv_caches)}")
        self.config = config
        self.layout = layout
        self.kv_caches = list(kv_caches)
        self.device = torch.device(device)
        self.dtype = kv_caches[0][0].dtype
        self.replica_id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self._listeners: list[TierListener] = []
        self.counters: Counter[str] = Counter()
        self.hot = HotPrefixes()
        self._hot_published: list[tuple[list[BlockHash], int]] | None = None
        self._s3_misses: OrderedDict[BlockHash, float] = OrderedDict()
        self._counter_lock = threading.Lock()
        self._s3_miss_lock = threading.Lock()  # the stager notes misses too
        self._read_seconds: Counter[str] = Counter()
        self._staging: dict[BlockHash, Future[int]] = {}  # first hash of a run being staged -> its read
        self._staged = threading.Event()  # set whenever a staged read ends: wakes an idle step loop

        block_bytes = layout.block_bytes
        self.cpu = (CpuTier(layout, max(1, int(config.cpu_gb * 2**30) // block_bytes), self.dtype,
                            pin_memory=self.device.type == "cuda", on_change=self._changed)
                    if config.cpu_gb > 0 else None)
        self.disk = (DiskTier(Path(config.disk_dir), layout, int(config.disk_gb * 2**30), on_change=self._changed)
                     if config.disk_dir else None)
        self.s3 = (S3Tier(config.s3_url, layout, endpoint_url=config.s3_endpoint_url, timeout_s=config.s3_timeout_s,
                          breaker=CircuitBreaker(config.s3_breaker_failures, config.s3_breaker_cooldown_s),
                          fetch_threads=config.s3_fetch_threads,
                          capacity_bytes=None if config.s3_gb is None else int(config.s3_gb * 2**30),
                          on_change=self._changed)
                   if config.s3_url else None)
        # The writer threads hold the store weakly, so that a dropped engine's store is collected and its
        # finalizer stops them; pending writes are a cache's, not a ledger's, and may be lost then.
        self.writers: dict[str, AsyncWriter] = {}
        if self.disk is not None:
            self.writers["disk"] = AsyncWriter("disk", _weak(self._write_disk), max_pending=config.max_pending_writes)
        if self.s3 is not None:
            self.writers["s3"] = AsyncWriter("s3", _weak(self._write_s3), max_pending=config.max_pending_writes,
                                             idle=_weak(self._publish_hot_if_changed), idle_s=config.hot_publish_s)
        below_cpu = self.disk is not None or self.s3 is not None  # (a DiskTier is falsy while empty: its len)
        self._stager = (ThreadPoolExecutor(2, thread_name_prefix="ember-kv-stage")
                        if config.async_loads and self.cpu is not None and below_cpu else None)
        self._staged_from: dict[BlockHash, str] = {}  # staged into the CPU tier from this tier: its hit, once loaded
        self._finalizer = weakref.finalize(self, _close_writers, list(self.writers.values()), self.s3, 1.0, True,
                                           self._stager)
        log.info("KV tiers: %s; model %s, %d-byte blocks, namespace %s", self.describe(), layout.model,
                 block_bytes, layout.namespace)

    # --- configuration -------------------------------------------------------------------------------

    @classmethod
    def for_engine(cls, option: KVTierConfig | Mapping[str, Any] | None, *, model_id: Callable[[], str],
                   block_size: int, kv_caches: Sequence[KVCache], device: torch.device,
                   tp_rank: int = 0, tp_size: int = 1) -> KVTierStore | None:
        """The engine's `kv_tiers=` option made into a store (None when no tier is on). `model_id` is called
        only then: hashing weights costs time that an engine without tiers should not spend."""
        config = KVTierConfig.from_value(option)
        if config is None or not config.any_tier:
            return None
        check_tierable(kv_caches, block_size)
        k_cache = kv_caches[0][0]  # [num_blocks, num_kv_heads, block_size, head_dim]
        layout = KVLayout(config.model_id or model_id(), str(k_cache.dtype).removeprefix("torch."), block_size,
                          len(kv_caches), int(k_cache.shape[1]), int(k_cache.shape[3]), tp_rank, tp_size)
        return cls(config, layout, kv_caches, device)

    def describe(self) -> str:
        parts = []
        if self.cpu is not None:
            parts.append(f"cpu {self.cpu.capacity} blocks")
        if self.disk is not None:
            parts.append(f"disk {self.disk.root} ({self.disk.capacity_bytes / 2**30:.1f} GiB)")
        if self.s3 is not None:
            parts.append(f"s3 {self.s3.url}")
        return ", ".join(parts) or "none"

    # --- the KV cache manager's connector (engine thread) ----------------------------------------------

    def save(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Copy newly computed device blocks into the CPU tier and queue them for disk and S3 (write-through)."""
        todo = [(b, h) for b, h in zip(block_ids, block_hashes, strict=True) if self.cpu is None or h not in self.cpu]
        if not todo:
            return
        ids = torch.tensor([b for b, _ in todo], dtype=torch.long, device=self.device)
        hashes = [h for _, h in todo]
        host = self._gather(ids)  # [n, *block_shape] on the host
        slots = self.cpu.reserve(hashes) if self.cpu is not None else [None] * len(todo)
        have_slot = [i for i, s in enumerate(slots) if s is not None]
        if self.cpu is not None and have_slot:
            picked = torch.tensor(have_slot, dtype=torch.long)
            self.cpu.buffer[torch.tensor([slots[i] for i in have_slot], dtype=torch.long)] = host[picked]
        self._count("saved_blocks", len(todo))
        with self._s3_miss_lock:
            for h in hashes:  # on its way to S3 now: a miss remembered from before must not hide it
                self._s3_misses.pop(h, None)
        for i, h in enumerate(hashes):
            slot = slots[i]
            data = self.cpu.buffer[slot] if self.cpu is not None and slot is not None else host[i]
            for writer in self.writers.values():
                self._submit(writer, h, data, slot)
            if slot is not None:
                self.cpu.unpin([slot])  # type: ignore[union-attr]

    def stage(self, block_hashes: Sequence[BlockHash]) -> bool:
        """Whether `fetch(block_hashes)` may run now without waiting on disk or S3. If not, a background read of
        the run into the CPU tier is under way (started now or before); ask again on a later step.

        One read per run: once it is done, `fetch` takes what it staged, and reads inline whatever did not fit
        in the CPU tier (a tier smaller than the run must not make the request wait for read after read)."""
        if self._stager is None or not block_hashes:
            return True  # no CPU tier to stage into, or inline reads asked for: fetch reads them itself
        key = block_hashes[0]  # a waiting request asks for the same run each step
        pending = self._staging.get(key)
        if pending is not None:
            if not pending.done():
                return False
            del self._staging[key]
            return True
        first_missing = next((h for h in block_hashes if h not in self.cpu), None)  # type: ignore[operator]
        if first_missing is None:
            return True
        in_disk = self.disk is not None and first_missing in self.disk
        may_be_in_s3 = self.s3 is not None and not self._recent_s3_miss(first_missing)
        if not (in_disk or may_be_in_s3):
            return True  # nothing below the CPU tier can have it: recompute from here, no waiting
        if len(self._staging) >= _MAX_STAGED:  # reads of requests that left before asking again
            for stale in [k for k, f in self._staging.items() if f.done()]:
                del self._staging[stale]
        run = list(block_hashes[list(block_hashes).index(first_missing):])
        future = self._stager.submit(self._stage_run, run)
        future.add_done_callback(lambda _: self._staged.set())
        self._staging[key] = future
        self._count("staged_reads")
        return False

    def _stage_run(self, run: list[BlockHash]) -> int:
        """On the stager thread: read `run` into the CPU tier; a block counts as a hit of the tier it came from when
        the request loads it, not now (it may be evicted before)."""
        fetched = self.fetch(run, count_hits=False)
        if len(self._staged_from) > _S3_MISS_MEMORY:  # loads that never came (their requests left)
            self._staged_from.clear()
        for f in fetched:
            if f.tier != "cpu" and f.slot is not None:
                self._staged_from[f.block_hash] = f.tier
        self.release(fetched)
        self._count("staged_blocks", len(fetched))
        return len(fetched)

    def wait_staged(self, timeout: float) -> None:
        """Block up to `timeout` seconds until a background read ends (the step loop has nothing else to do)."""
        if any(not f.done() for f in self._staging.values()):
            self._staged.wait(timeout)
        self._staged.clear()

    def fetch(self, block_hashes: Sequence[BlockHash], *, count_hits: bool = True) -> list[FetchedBlock]:
        """The longest leading run of `block_hashes` found in the tiers, each pinned on the host until `load`.

        Never raises for a tier's failure: a block that cannot be had ends the run, and the rest is recomputed.
        """
        out: list[FetchedBlock] = []
        i = 0
        while i < len(block_hashes):
            h = block_hashes[i]
            slot = self.cpu.acquire(h) if self.cpu is not None else None
            if slot is not None:
                out.append(FetchedBlock(h, "cpu", self.cpu.buffer[slot], slot))  # type: ignore[union-attr]
            else:
                t0 = time.perf_counter()
                data = self._read_disk(h) if self.disk is not None else None
                if data is None:
                    break
                out.append(self._promote(h, "disk", data))
                self._measure("disk", self.layout.block_bytes, time.perf_counter() - t0)
            i += 1
        rest = block_hashes[i:]
        if rest and self.s3 is not None and not self._recent_s3_miss(rest[0]):
            t0 = time.perf_counter()
            try:
                blobs = self.s3.get_run(rest)
            except S3Unavailable as e:
                self._count("s3_fallbacks")  # the request recomputes what S3 may have held
                log.debug("KV tiers: S3 lookup failed, recomputing: %s", e)
                blobs = []
            if not blobs:
                self._note_s3_miss(rest[0])
            found = len(out)
            for h, blob in zip(rest, blobs, strict=False):
                data = self._decode("s3", h, blob)
                if data is None:
                    break
                out.append(self._promote(h, "s3", data))
            if len(out) > found:
                self._measure("s3", (len(out) - found) * self.layout.block_bytes, time.perf_counter() - t0)
        if count_hits:
            for f in out:
                self._count(f"{self._staged_from.pop(f.block_hash, f.tier)}_hits")
        return out

    def load(self, fetched: Sequence[FetchedBlock], block_ids: Sequence[int]) -> None:
        """Copy fetched blocks into device blocks `block_ids` (every layer), then unpin them."""
        t0 = time.perf_counter()
        try:
            if not fetched:
                return
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
            # src: [n, layers, 2, kv_heads, block_size, head_dim] on the host, pinned for a GPU (one DMA up)
            src = torch.empty((len(fetched), *self.layout.block_shape), dtype=self.dtype,
                              pin_memory=self.device.type == "cuda")
            if self.cpu is not None and all(f.slot is not None for f in fetched):
                slots = torch.tensor([f.slot for f in fetched], dtype=torch.long)
                torch.index_select(self.cpu.buffer, 0, slots, out=src)
            else:
                torch.stack([f.data for f in fetched], out=src)
            src = src.to(self.device)
            for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                k_cache[ids] = src[:, layer, 0]
                v_cache[ids] = src[:, layer, 1]
            self._count("loaded_tokens", len(fetched) * self.layout.block_size)
            # Host -> device, for blocks already on the host: the CPU tier's cost.
            self._measure("cpu", len(fetched) * self.layout.block_bytes, time.perf_counter() - t0)
        finally:
            self.release(fetched)

    def release(self, fetched: Sequence[FetchedBlock]) -> None:
        """Unpin fetched blocks that will not be loaded."""
        if self.cpu is not None:
            self.cpu.unpin([f.slot for f in fetched if f.slot is not None])

    def note_prefix(self, block_hashes: Sequence[BlockHash]) -> None:
        """A request's prompt blocks, counted towards the hot prefixes that seed fresh replicas."""
        if block_hashes:
            self.hot.note(block_hashes)

    # --- seeding --------------------------------------------------------------------------------------

    def prefetch(self, chain: Sequence[BlockHash]) -> int:
        """Bring a prefix into the CPU tier (from disk or S3); the number of its leading blocks found."""
        fetched = self.fetch(chain)
        self.release(fetched)
        return len(fetched)

    def publish_hot(self, n: int = 32) -> bool:
        """Upload this replica's `n` hottest prefixes to S3, where fresh replicas find them; False if S3 is off
        or unavailable."""
        if self.s3 is None:
            return False
        top = self.hot.top(n)
        doc = {"replica": self.replica_id, "time": time.time(),
               "chains": [[h.hex() for h in chain] for chain, _ in top], "scores": [score for _, score in top]}
        try:
            self.s3.put_json(f"{HOT_FOLDER}/{self.replica_id}.json", doc)
        except S3Unavailable as e:
            log.debug("KV tiers: publishing hot prefixes failed: %s", e)
            return False
        self._hot_published = top
        return True

    def hot_prefixes(self, n: int = 32) -> list[list[BlockHash]]:
        """The `n` hottest prefixes over every replica that published to the shared S3 tier, else this one's."""
        if self.s3 is not None:
            try:
                merged = merge_hot_lists(self.s3.read_json_under(HOT_FOLDER), n)
            except S3Unavailable as e:
                log.warning("KV tiers: cannot read the shared hot prefixes (%s); using this replica's own", e)
            else:
                if merged:
                    return merged
        return [chain for chain, _ in self.hot.top(n)]

    def _publish_hot_if_changed(self) -> None:
        top = self.hot.top(32)
        if top and top != self._hot_published:
            self.publish_hot()

    # --- tier membership (for routing) ---------------------------------------------------------------

    def add_listener(self, listener: TierListener) -> None:
        """`listener(TierEvent)` on every change of a tier's membership, from the thread that changed it."""
        self._listeners.append(listener)

    @property
    def shared_store(self) -> str:
        """The S3 store's name for the routing tables ("" without S3): endpoint, bucket and this model's prefix."""
        return self.s3.store_id if self.s3 is not None else ""

    def membership(self) -> dict[str, list[BlockHash]]:
        """Every block each tier holds now (for a full resync of the routing tables); S3: this replica's uploads."""
        return {name: tier.hashes() for name, tier in (("cpu", self.cpu), ("disk", self.disk), ("s3", self.s3))
                if tier is not None}

    def _changed(self, tier: str, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        self._count(f"{tier}_stored", len(stored))
        self._count(f"{tier}_evicted", len(removed))
        if self._listeners:
            event = TierEvent(tier, stored, removed)
            for listener in list(self._listeners):
                try:
                    listener(event)
                except Exception:  # a listener's bug must not stop a writer thread or a step
                    log.exception("KV tier listener %r failed", listener)

    # --- internals ------------------------------------------------------------------------------------

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Device blocks `ids` of every layer as one host tensor [n, layers, 2, kv_heads, block_size, head_dim]."""
        if self.device.type != "cpu":
            # Gather on the device, then one copy down into pinned memory (a DMA), not 2 x layers small ones.
            blocks = torch.stack([torch.stack((k[ids], v[ids]), dim=1) for k, v in self.kv_caches], dim=1)
            return torch.empty(blocks.shape, dtype=self.dtype, pin_memory=True).copy_(blocks)
        out = torch.empty((len(ids), *self.layout.block_shape), dtype=self.dtype)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            out[:, layer, 0] = k_cache[ids]
            out[:, layer, 1] = v_cache[ids]
        return out

    def _promote(self, block_hash: BlockHash, tier: str, data: torch.Tensor) -> FetchedBlock:
        """A block found on disk or in S3: into the CPU tier (if any) and, from S3, onto the disk tier."""
        slot = self.cpu.reserve([block_hash])[0] if self.cpu is not None else None
        if slot is not None:
            self.cpu.buffer[slot].copy_(data)  # type: ignore[union-attr]
            data = self.cpu.buffer[slot]  # type: ignore[union-attr]
        if tier == "s3" and "disk" in self.writers:
            self._submit(self.writers["disk"], block_hash, data, slot)
        return FetchedBlock(block_hash, tier, data, slot)

    def _submit(self, writer: AsyncWriter, block_hash: BlockHash, data: torch.Tensor, slot: int | None) -> None:
        done = None
        if slot is not None:
            assert self.cpu is not None
            cpu = self.cpu
            cpu.pin(slot)  # the slot's bytes must not change until the writer has read them

            def done() -> None:
                cpu.unpin([slot])

        writer.submit(WriteJob(block_hash, data, done))

    def _write_disk(self, job: WriteJob) -> None:
        assert self.disk is not None
        self.disk.put(job.block_hash, encode_block(self.layout, job.block_hash, _payload(job.data)))

    def _write_s3(self, job: WriteJob) -> None:
        assert self.s3 is not None
        self.s3.put(job.block_hash, b"".join(encode_block(self.layout, job.block_hash, _payload(job.data))))

    def _read_disk(self, block_hash: BlockHash) -> torch.Tensor | None:
        assert self.disk is not None
        try:
            blob = self.disk.get(block_hash)
        except OSError as e:
            self._count("disk_errors")
            log.warning("KV disk tier: cannot read block %s: %s", block_hash.hex(), e)
            return None
        return None if blob is None else self._decode("disk", block_hash, blob)

    def _decode(self, tier: str, block_hash: BlockHash, blob: bytearray) -> torch.Tensor | None:
        try:
            payload = decode_block(self.layout, block_hash, blob)
        except CorruptBlockError as e:
            self._count("corrupt_blocks")
            log.warning("KV %s tier: block %s is corrupt (%s): dropped, recomputing", tier, block_hash.hex(), e)
            self._discard(tier, block_hash)
            return None
        except HeaderMismatchError as e:
            self._count("rejected_blocks")
            log.warning("KV %s tier: refused block %s: %s", tier, block_hash.hex(), e)
            self._discard(tier, block_hash)
            return None
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.layout.block_shape)

    def _discard(self, tier: str, block_hash: BlockHash) -> None:
        # S3 objects are left alone: they are shared, and this replica's recomputed block overwrites the key.
        if tier == "disk" and self.disk is not None:
            self.disk.discard(block_hash)

    def _recent_s3_miss(self, block_hash: BlockHash) -> bool:
        with self._s3_miss_lock:
            seen = self._s3_misses.get(block_hash)
        return seen is not None and time.monotonic() - seen < _S3_MISS_TTL_S

    def _note_s3_miss(self, block_hash: BlockHash) -> None:
        with self._s3_miss_lock:
            self._s3_misses[block_hash] = time.monotonic()
            self._s3_misses.move_to_end(block_hash)
            while len(self._s3_misses) > _S3_MISS_MEMORY:
                self._s3_misses.popitem(last=False)

    def _measure(self, tier: str, num_bytes: int, seconds: float) -> None:
        with self._counter_lock:
            self.counters[f"{tier}_read_bytes"] += num_bytes
            self._read_seconds[tier] += seconds

    def read_bandwidth(self) -> dict[str, float]:
        """Measured bytes/s of reading blocks from each tier so far (for the router's fetch-vs-recompute price:
        a block costs `layout.block_bytes / bandwidth` seconds from that tier)."""
        with self._counter_lock:
            return {tier: self.counters[f"{tier}_read_bytes"] / seconds
                    for tier, seconds in self._read_seconds.items() if seconds > 0}

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:  # writer threads count too
            self.counters[name] += n

    # --- metrics and lifecycle ------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and sizes, each named `kv_tier_*` (merged into the engine's stats): `<tier>_hits` blocks loaded
        from a tier, `loaded_tokens` in all, `saved_blocks` written through, `<tier>_stored` / `_evicted`
        membership changes, `<tier>_blocks` held now, `corrupt_blocks` and `rejected_blocks` (another model's)
        dropped, `s3_fallbacks` lookups S3 could not answer (recomputed), writer queue counts, and
        `<tier>_read_bandwidth` in bytes/s."""
        with self._counter_lock:
            out: dict[str, float] = {f"kv_tier_{k}": float(v) for k, v in self.counters.items()}
        for tier, bandwidth in self.read_bandwidth().items():
            out[f"kv_tier_{tier}_read_bandwidth"] = bandwidth
        for name, tier in (("cpu", self.cpu), ("disk", self.disk)):
            if tier is not None:
                out[f"kv_tier_{name}_blocks"] = float(len(tier))
        for name, writer in self.writers.items():
            out[f"kv_tier_{name}_writes"] = float(writer.num_written)
            out[f"kv_tier_{name}_dropped_writes"] = float(writer.num_dropped)
            out[f"kv_tier_{name}_failed_writes"] = float(writer.num_failed)
            out[f"kv_tier_{name}_pending_writes"] = float(writer.num_pending)
        if self.s3 is not None:
            out["kv_tier_s3_errors"] = float(self.s3.num_errors)
            out["kv_tier_s3_skipped"] = float(self.s3.num_skipped)
            out["kv_tier_s3_breaker_open"] = float(self.s3.breaker.state != "closed")
        return out

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every queued write is done (tests, benchmarks, a draining replica)."""
        return all(writer.flush(timeout) for writer in self.writers.values())

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout` per tier) and stop the writer and stager threads."""
        self._finalizer.detach()
        _close_writers(list(self.writers.values()), self.s3, timeout, False, self._stager)


def _payload(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    return memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def _close_writers(writers: list[AsyncWriter], s3: S3Tier | None, timeout: float, drop: bool,
                   stager: ThreadPoolExecutor | None = None) -> None:
    if stager is not None:
        stager.shutdown(wait=False, cancel_futures=True)  # a read still under way finds S3 closed and ends
    for writer in writers:
        writer.close(timeout, drop=drop)
    if s3 is not None:
        s3.close()
