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

That layout is the default, not a rule: a backend declares its own `KVCacheSpec` (the per-block shape and
dtype of every tensor of a layer's cache, K and V first, then e.g. the scales of a quantized cache), the KV
dtypes it can store (`kv_cache_dtypes`: "auto" is the model's dtype, "int8" / "fp8" where it quantizes) and
the block sizes it takes; the worker allocates and sizes the cache from that spec. A backend may also give a
metadata builder, which the runner calls once per step (not once per layer) to plan the step's attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

KVCache = tuple[torch.Tensor, ...]
"""One layer's cache: the tensors of its `KVCacheSpec`, in order (K and V first; a quantized cache adds its scales)."""

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
"""`[runtime] kv_cache_dtype` values -> the stored dtype ("auto": the model's dtype)."""


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """What a backend is told about the layers it serves (one backend per distinct configuration)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale (usually head_dim ** -0.5)
    sliding_window: int | None = None  # a query at position p sees p - W + 1 .. p; None: the whole context
    dtype: torch.dtype = torch.float32  # the model's compute dtype: q, k, v and the output


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One layer's paged KV cache as its backend lays it out: the tensors the worker allocates for it.

    `tensors`: (per-block shape, dtype) of each tensor of the cache tuple, K and V first; the worker allocates
    `[num_blocks, *shape]` of each with zeros. `layout` names the layout (KV tiers store blocks of the default
    "HND" only); `kv_cache_dtype` is the `[runtime]` value it stores ("auto": the model's dtype, unquantized).
    """

    layout: str
    block_size: int
    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if len(self.tensors) < 2:
            raise ValueError(f"a KV cache spec needs at least K and V, got {len(self.tensors)} tensors")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of this layer costs: K, V and whatever else the spec holds (scales)."""
        total = 0
        for shape, dtype in self.tensors:
            n = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                n *= d
            total += n
        return total

    def allocate(self, num_blocks: int, device: torch.device | str) -> KVCache:
        return tuple(torch.zeros((num_blocks, *shape), dtype=dtype, device=device) for shape, dtype in self.tensors)


def hnd_kv_cache_spec(layer: AttentionLayerSpec, block_size: int, kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """The default layout (module docstring): K and V `[Hkv, block_size, D]` per block; quantized ("int8",
    "fp8"), each adds a float32 scale per token and KV head, `[Hkv, block_size]` per block."""
    block = kv_cache_block_shape(block_size, layer.num_kv_heads, layer.head_dim)
    stored = KV_CACHE_DTYPES[kv_cache_dtype] or layer.dtype
    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ((block, stored), (block, stored))
    if kv_cache_dtype != "auto":
        scales = (layer.num_kv_heads, block_size)
        tensors += ((scales, torch.float32), (scales, torch.float32))
    return KVCacheSpec("HND", block_size, tensors, kv_cache_dtype)


def check_backend_settings(backend: Any, kv_cache_dtype: str, block_size: int) -> None:
    """ValueError unless the backend class stores `kv_cache_dtype` and takes `block_size`, naming what it does."""
    name = getattr(backend, "name", getattr(backend, "__name__", repr(backend)))
    dtypes = tuple(getattr(backend, "kv_cache_dtypes", ("auto",)))
    if kv_cache_dtype not in dtypes:
        raise ValueError(f"[runtime] kv_cache_dtype = {kv_cache_dtype!r}: attention backend '{name}' supports "
                         f"{', '.join(map(repr, dtypes))}")
    sizes = getattr(backend, "block_sizes", None)
    if sizes is not None and block_size not in sizes:
        raise ValueError(f"[runtime] kv_block_size = {block_size}: attention backend '{name}' supports block sizes "
                         f"{', '.join(map(str, sizes))}")


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
    k_cache, v_cache = kv_cache[0], kv_cache[1]
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
    # Tree drafts (spec_tree.py): batch index -> [q_len, q_len] bool on the host, over that request's query run
    # (its newest token, then its draft nodes): query j sees query-run key j' only where the mask is set (itself and
    # its ancestors); keys before the run are seen as usual. Empty on every step without a tree. Only backends
    # whose class sets `supports_tree_attention = True` get such steps (the engine refuses a tree speculator
    # otherwise).
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
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
class AttentionMetadataBuilder(Protocol):
    """A backend's per-step planner: the runner calls `build(meta)` once per step, before the forward pass, so
    that every layer finds the plan ready (in `meta.scratch`, under the backend's own key). Builders keep their
    buffers across steps rather than allocating per step, and plan with tensor ops, not per-token Python; so a
    step's plan is valid until the builder's next `build` (the runner finishes a step before planning the next)."""

    def build(self, meta: AttentionMetadata) -> None:
        ...


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention for one layer configuration.

    Implementations are constructed by the model as `Backend(layer=AttentionLayerSpec, ops=KernelOps)`, one per
    distinct attention configuration (a sliding window of W lets a query at position p see positions
    p - W + 1 .. p, as in Mistral); the engine adds `kv_cache_dtype="auto" | "int8" | "fp8"` (one of the class's
    `kv_cache_dtypes`) and the manifest's `[kernels] options` as keyword arguments (only keys the plugin declared
    with `register(..., options=(...))` get through). `ops` is the engine's kernel-op table, the one the model's
    layers call: a backend stores a step's K/V with `ops.write_kv(kv_cache, k, v, meta.slot_mapping,
    meta.scratch)` (or its own kernel for a layout of its own).

    Class attributes: `name`; `kv_cache_dtypes` (default ("auto",)); `block_sizes` (None: any the manifest
    allows); `supports_tree_attention` (default False: it ignores `meta.tree_masks`, so the engine refuses a
    speculator that drafts trees with it; a backend that sets it honours the masks and keeps the default "HND"
    layout, in which the engine moves an accepted path's KV by slot). Methods: `kv_cache_spec(block_size)` (the
    layout the worker allocates), `metadata_builder(block_size, device)` (None, or the per-step planner), `forward`.
    """

    name: str

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        """This layer's cache layout and dtypes for blocks of `block_size` tokens."""
        ...

    def metadata_builder(self, block_size: int, device: torch.device) -> AttentionMetadataBuilder | None:
        """The object the runner calls once per step to plan for this backend on `device` (None: the backend
        plans inside `forward`, or has nothing to plan)."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) into the cache (its `kv_cache_spec` tensors) at `meta.slot_mapping`, then attend.

        Each query token of q ([T, H, D], H a multiple of Hkv) attends causally to its request's
        context read through `meta.block_tables`. Returns [T, H, D] in q's dtype.
        """
        ...


AttentionBackendFactory = Callable[..., AttentionBackend]
