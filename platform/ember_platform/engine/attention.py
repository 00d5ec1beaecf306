"""The paged-attention API: the per-step metadata and the protocol attention backends implement.

This is the documented engine API that attention plugins ("torch", "triton", "flashinfer", ...)
build on. One engine step runs the model over a flattened batch of T tokens from B requests;
each request contributes a contiguous run of query tokens (a prefill chunk, one decode token, or
1 + k speculative tokens) which are the *last* `query_lens[i]` positions of its context.

KV cache layout, per layer: a pair `(k_cache, v_cache)`, each `[num_blocks, num_kv_heads,
block_size, head_dim]` ("HND", as vLLM's CPU and FlashInfer's HND layouts): a block is one
contiguous run of memory (the unit that prefix caching shares and KV tiers move), and within it
each KV head's keys are contiguous, so a gathered block is ready for a batched matmul per head.
Token at context position `p` of request `i` lives in block `block_tables[i, p // block_size]`
at offset `p % block_size`; `write_kv` stores a step's new K/V there. The engine allocates
caches with `torch.zeros`: backends may read (and mask out) slots past a sequence's end, and a
NaN left in never-written memory would survive the mask (0 * NaN = NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]


def kv_cache_block_shape(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """The shape of one cache block (per layer, K or V): the layout every backend reads."""
    return (num_kv_heads, block_size, head_dim)


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             scratch: dict[str, Any] | None = None) -> None:
    """Store new keys and values k, v ([T, Hkv, D]) at their slots (block_id * block_size + offset).

    The torch reference of the `write_kv` kernel op: backends call `ops.write_kv`, which runs a plugin's
    copy where one takes the inputs, else this. `scratch`, the step's `AttentionMetadata.scratch`, lets it
    compute the cache rows once per step rather than once per layer.
    """
    k_cache, v_cache = kv_cache
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    key = f"write_kv:{num_kv_heads}:{block_size}"
    rows = None if scratch is None else scratch.get(key)
    if rows is None:
        # Row of the cache viewed as [num_blocks * Hkv * block_size, D] for token t, KV head h, in (t, h) order.
        offsets = slot_mapping % block_size
        blocks = slot_mapping // block_size
        heads = torch.arange(num_kv_heads, device=slot_mapping.device) * block_size
        rows = ((blocks * (num_kv_heads * block_size) + offsets)[:, None] + heads[None, :]).reshape(-1)
        if scratch is not None:
            scratch[key] = rows
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_cache.dtype))


@dataclass(slots=True)
class AttentionMetadata:
    """Everything an attention backend needs to know about one engine step.

    Tensors live on the model's device; the `*_list` / `max_*` fields are the same facts on the
    Python side, so that backends can plan (chunk counts, per-request loops) without a device sync.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token's K/V
    query_start_loc: torch.Tensor  # [B + 1] int64: request i owns tokens query_start_loc[i]:query_start_loc[i+1]
    seq_lens: torch.Tensor  # [B] int64: context length of each request, this step's tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with a valid block id (0): read, then masked
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every request has exactly one query token
    # Per-step tensors a backend derives once and reuses in every layer (keyed by the backend).
    scratch: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        num_reqs = len(self.query_lens)
        if len(self.seq_lens_list) != num_reqs:
            raise ValueError(f"query_lens has {num_reqs} entries but seq_lens_list has {len(self.seq_lens_list)}")
        if any(q < 1 or q > s for q, s in zip(self.query_lens, self.seq_lens_list, strict=True)):
            raise ValueError(f"each request needs 1 <= query_len <= seq_len; got query_lens={self.query_lens}, "
                             f"seq_lens={self.seq_lens_list}")
        if self.decode_only != all(q == 1 for q in self.query_lens):
            raise ValueError(f"decode_only={self.decode_only} disagrees with query_lens={self.query_lens}")

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata from Python lists: per request its query length, context length and block ids.

        The slots of the new tokens follow from the block tables (query tokens are the last
        positions of each context). Block tables are padded with 0 to the longest one.
        """
        query_lens, seq_lens = list(query_lens), list(seq_lens)
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if len(table) * block_size < s_len:
                raise ValueError(f"a block table of {len(table)} blocks of {block_size} cannot hold {s_len} tokens")
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len))
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(padded), max_blocks),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            decode_only=all(q == 1 for q in query_lens),
        )


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention for one layer configuration.

    Implementations are constructed by the model as `Backend(sliding_window=None | int, ops=KernelOps)`,
    one per distinct attention configuration (a sliding window of W lets a query at position p see
    positions p - W + 1 .. p, as in Mistral). `ops` is the engine's kernel-op table, the one the model's
    layers call: a backend stores a step's K/V with `ops.write_kv(kv_cache, k, v, meta.slot_mapping,
    meta.scratch)` (or its own kernel for a layout of its own).
    """

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) into the cache at `meta.slot_mapping`, then attend.

        Each query token of q ([T, H, D], H a multiple of Hkv) attends causally to its request's
        context read through `meta.block_tables`. Returns [T, H, D] in q's dtype.
        """
        ...


AttentionBackendFactory = Callable[..., AttentionBackend]
