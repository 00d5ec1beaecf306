"""The two local tiers: host RAM (a slab of block slots) and local disk (one file per block), each an LRU cache
with a capacity. Both report membership changes through `on_change(tier, stored, removed)`."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from ember_platform.engine.block_hash import BlockHash
from ember_platform.kvtiers.format import KVLayout

log = logging.getLogger("ember.kvtiers")

OnChange = Callable[[str, list[BlockHash], list[BlockHash]], None]
BLOCK_SUFFIX = ".kvb"


class CpuTier:
    """Blocks in one preallocated host tensor `[capacity, *layout.block_shape]` (pinned when the device is a GPU,
    so copies to and from it run at full PCIe speed), indexed by block hash, least recently used first.

    A slot can be pinned (a pending disk/S3 write reads it, or a fetched block awaits its copy to the device):
    eviction passes over pinned slots, so their bytes never change under a reader.
    """

    name = "cpu"

    def __init__(self, layout: KVLayout, capacity_blocks: int, dtype: torch.dtype, *, pin_memory: bool = False,
                 on_change: OnChange | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError("the CPU tier needs room for at least one block")
        self.capacity = capacity_blocks
        self.buffer = torch.empty((capacity_blocks, *layout.block_shape), dtype=dtype, pin_memory=pin_memory)
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # first = least recently used
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._pins: Counter[int] = Counter()
        self._lock = threading.Lock()  # writer threads unpin; everything else runs on the engine's thread
        self._on_change = on_change
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def hashes(self) -> list[BlockHash]:
        """Every block held now (a publisher's full resync)."""
        with self._lock:
            return list(self._slots)

    def acquire(self, block_hash: BlockHash) -> int | None:
        """The slot holding `block_hash`, pinned and marked most recently used; None on a miss."""
        with self._lock:
            slot = self._slots.get(block_hash)
            if slot is not None:
                self._slots.move_to_end(block_hash)
                self._pins[slot] += 1
            return slot

    def reserve(self, block_hashes: Sequence[BlockHash]) -> list[int | None]:
        """A pinned slot for each new hash, to be filled by the caller now (on the engine's thread, before anyone
        can read it); None for a hash already here or when every slot is pinned."""
        out: list[int | None] = []
        stored: list[BlockHash] = []
        removed: list[BlockHash] = []
        with self._lock:
            for h in block_hashes:
                if h in self._slots:
                    out.append(None)
                    continue
                slot = self._free.pop() if self._free else self._evict_one(removed)
                if slot is not None:
                    self._slots[h] = slot
                    self._pins[slot] += 1
                    stored.append(h)
                out.append(slot)
        self._notify(stored, removed)
        return out

    def _evict_one(self, removed: list[BlockHash]) -> int | None:
        for h, slot in self._slots.items():
            if not self._pins[slot]:
                del self._slots[h]
                removed.append(h)
                self.num_evicted += 1
                return slot
        return None

    def pin(self, slot: int) -> None:
        """One more reader of `slot` (a queued write): it stays until unpinned."""
        with self._lock:
            self._pins[slot] += 1

    def unpin(self, slots: Iterable[int]) -> None:
        with self._lock:
            for slot in slots:
                self._pins[slot] -= 1
                if self._pins[slot] <= 0:
                    del self._pins[slot]

    def discard(self, block_hash: BlockHash) -> None:
        """Forget a block (its slot is reused once unpinned)."""
        with self._lock:
            slot = self._slots.pop(block_hash, None)
            if slot is None:
                return
            self._free.append(slot)
        self._notify([], [block_hash])

    def _notify(self, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        if self._on_change is not None and (stored or removed):
            self._on_change(self.name, stored, removed)


class DiskTier:
    """One file per block under `root/<layout namespace>/<2 hex>/<hash hex>.kvb`, written atomically (temp file,
    rename), evicted least recently used first by an index of sizes kept in memory.

    The index is rebuilt from the directory at start-up (oldest modification first; reads refresh a file's
    mtime), so a restarted replica keeps its disk tier. A file another process on the same host wrote is
    found on a miss in the index.
    """

    name = "disk"

    def __init__(self, root: Path, layout: KVLayout, capacity_bytes: int, *, on_change: OnChange | None = None) \
            -> None:
        self.root = Path(root) / layout.namespace
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # first = least recently used
        self._bytes = 0
        self._lock = threading.Lock()
        self._on_change = on_change
        self.num_evicted = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.root.glob(f"*/*{BLOCK_SUFFIX}"):
            try:
                block_hash = bytes.fromhex(path.name.removesuffix(BLOCK_SUFFIX))
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, block_hash, stat.st_size))
        for _mtime, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._bytes += size
        self._trim([])

    def path(self, block_hash: BlockHash) -> Path:
        hex_hash = block_hash.hex()
        return self.root / hex_hash[:2] / f"{hex_hash}{BLOCK_SUFFIX}"

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[BlockHash]:
        """Every block this process knows to be here (a publisher's full resync)."""
        with self._lock:
            return list(self._index)

    def get(self, block_hash: BlockHash) -> bytearray | None:
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size)  # writable: the payload becomes a tensor without another copy
                n = f.readinto(data)
            os.utime(path)  # least recently *used*, across restarts too
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            else:
                self._index[block_hash] = size
                self._bytes += size
        return data[:n] if n != size else data

    def put(self, block_hash: BlockHash, chunks: Iterable[bytes | memoryview]) -> None:
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                size = f.tell()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        removed: list[BlockHash] = []
        with self._lock:
            self._bytes -= self._index.pop(block_hash, 0)
            self._index[block_hash] = size
            self._bytes += size
            self._trim(removed)
        if block_hash in removed:  # bigger than the whole tier: gone at once
            self._notify([], [h for h in removed if h != block_hash])
        else:
            self._notify([block_hash], removed)

    def discard(self, block_hash: BlockHash) -> None:
        """Delete a block that must not be read again (corrupt, or another model's)."""
        with contextlib.suppress(OSError):
            self.path(block_hash).unlink()
        if self._forget(block_hash):
            self._notify([], [block_hash])

    def _forget(self, block_hash: BlockHash) -> bool:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
            return size is not None

    def _trim(self, removed: list[BlockHash]) -> None:
        """Evict least recently used files until the tier fits (caller holds the lock)."""
        while self._bytes > self.capacity_bytes and self._index:
            block_hash, size = self._index.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(OSError):
                self.path(block_hash).unlink()
            removed.append(block_hash)
            self.num_evicted += 1

    def _notify(self, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        if self._on_change is not None and (stored or removed):
            self._on_change(self.name, stored, removed)
