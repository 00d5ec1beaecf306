"""Which prefixes a replica serves most: what a fresh replica should load before it takes traffic.

Every prompt's full-block hash chain is counted block by block (a block hash names a whole prefix), so a
system prompt shared by many requests scores high even though each prompt's tail is unique. A prefix is worth
`count x length` (the prefill tokens it saved or would save); the hottest are returned as whole chains, and a
chain already chosen covers its own ancestors.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ember_platform.engine.block_hash import BlockHash


@dataclass(slots=True)
class _Entry:
    parent: BlockHash | None
    depth: int  # blocks in the prefix this hash names
    count: int = 0


class HotPrefixes:
    """Counts per prefix, bounded to the `max_entries` most recently seen prefixes."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # noted on the engine's thread, read by the S3 writer's periodic upload

    def note(self, chain: Sequence[BlockHash]) -> None:
        """One request's prompt, as its full blocks' hashes from the first."""
        with self._lock:
            parent: BlockHash | None = None
            for depth, h in enumerate(chain, start=1):
                entry = self._entries.get(h)
                if entry is None:
                    entry = self._entries[h] = _Entry(parent, depth)
                else:
                    self._entries.move_to_end(h)
                entry.count += 1
                parent = h
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def top(self, n: int, min_count: int = 2) -> list[tuple[list[BlockHash], int]]:
        """Up to `n` (chain, score) pairs, hottest first, none an ancestor of another."""
        with self._lock:
            ranked = sorted(((e.count * e.depth, h) for h, e in self._entries.items() if e.count >= min_count),
                            reverse=True)
            covered: set[BlockHash] = set()
            out: list[tuple[list[BlockHash], int]] = []
            for score, h in ranked:
                if len(out) >= n:
                    break
                if h in covered:
                    continue
                chain = self._chain(h)
                if chain is None:
                    continue  # an ancestor was forgotten: the chain cannot be loaded from its start
                covered.update(chain)
                out.append((chain, score))
            return out

    def _chain(self, tip: BlockHash) -> list[BlockHash] | None:
        chain = [tip]
        entry = self._entries[tip]
        while entry.parent is not None:
            parent = self._entries.get(entry.parent)
            if parent is None:
                return None
            chain.append(entry.parent)
            entry = parent
        chain.reverse()
        return chain


def merge_hot_lists(docs: Iterable[object], n: int) -> list[list[BlockHash]]:
    """The `n` hottest chains over several replicas' published lists (`{"chains": [[hex, ...], ...],
    "scores": [...]}`), scores summed per chain; malformed entries are skipped."""
    scores: dict[tuple[BlockHash, ...], int] = {}
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        chains, doc_scores = doc.get("chains"), doc.get("scores")
        if not isinstance(chains, list) or not isinstance(doc_scores, list):
            continue
        for chain, score in zip(chains, doc_scores, strict=False):
            try:
                key = tuple(bytes.fromhex(h) for h in chain)
            except (TypeError, ValueError):
                continue
            if key and isinstance(score, int | float):
                scores[key] = scores.get(key, 0) + int(score)
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
    out: list[list[BlockHash]] = []
    covered: set[BlockHash] = set()
    for chain, _score in ranked:
        if len(out) >= n:
            break
        if chain[-1] in covered:
            continue
        covered.update(chain)
        out.append(list(chain))
    return out
