"""Paged attention in plain PyTorch, for CPU and CUDA: the portable "torch" backend.

Requests with short query runs (decode, speculative 1 + k tokens, tiny prefill chunks) share one
batched path over a *ragged* list of (request, block) pairs: every block any of them reads is
gathered once, scores come from one batched matmul per step and layer, and a request's blocks
are merged with an exact softmax (a per-request maximum, then sums per request). Nothing is
padded to the batch's longest context and no request's context is copied out whole; long
contexts are processed a bounded number of blocks at a time. Requests with long query runs
(prefill chunks) are few per step and compute-bound, so each gathers its own context once and
runs SDPA with an offset causal mask.

On CPU the short path runs a native kernel instead when one could be built
(`ember_kernels.cpu.paged_attention`: it reads the blocks in place, where torch ops must gather
them first); the torch path is the portable fallback and the reference the kernel is tested against.

Cache layout (see `ember_platform.api.AttentionMetadata`): `[num_blocks, num_kv_heads, block_size,
head_dim]`, so a gathered block is already head-major and scores need no transposing copy. New K/V are
stored with the engine's kernel-op table (`ops.write_kv`), the one the model was built with.

KV cache dtypes: "auto" (the model's dtype), "int8" and "fp8" (e4m3). A quantized cache holds a float32 scale
per token and KV head next to K and V (`hnd_kv_cache_spec`): `write_kv` stores round(x / s) with s = max|x| / 127
(int8) or x / s with s = max|x| / 448 (fp8) over the head's D values, and every read multiplies the gathered
blocks by their scales (the torch path; the native kernel reads model-dtype caches only).

The step's plan (which requests take which path, the ragged work list, masks) is built once per step by the
backend's metadata builder, with tensor ops into buffers it keeps across steps; every layer then reuses it.
Options (`[kernels] options`): `max_batched_query_len`, `chunk_elements`, `native` (see `TorchPagedAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ember_kernels.cpu import paged_attention, paged_attention_available
from ember_platform.api import (
    AttentionLayerSpec,
    AttentionMetadata,
    KernelOps,
    KVCache,
    KVCacheSpec,
    hnd_kv_cache_spec,
)

OPTIONS = ("max_batched_query_len", "chunk_elements", "native")  # the [kernels] options this backend reads
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # largest stored magnitude per quantized dtype


@dataclass(slots=True)
class _LongRequest:
    """One request answered by SDPA: its tokens, the block range it reads, and its mask."""

    token_start: int
    token_end: int
    request: int
    first_block: int
    end_block: int
    num_keys: int
    mask: torch.Tensor | None  # [q_len, num_keys] bool; None means plain causal from position 0


@dataclass(slots=True)
class _ShortPlan:
    """The batched path's work list: one entry per (short request, block it reads)."""

    tokens: torch.Tensor | None  # [Bs, Q] token index of each padded query; None: q already is [B, Q]
    valid: torch.Tensor | None  # [Bs * Q] rows of the padded result that are real tokens
    num_requests: int
    num_q: int
    q_pos: torch.Tensor  # [Bs, Q] context position of each query, -1 for padding
    # For the native kernel: each short request's block table and the block range it reads.
    tables: torch.Tensor | None = None  # [Bs, T] int32
    first_block: torch.Tensor | None = None  # [Bs]
    end_block: torch.Tensor | None = None  # [Bs]
    # For the torch path: the ragged work list.
    blocks: torch.Tensor | None = None  # [NB] cache block id of each entry
    owner: torch.Tensor | None = None  # [NB] which short request (0..Bs-1) the entry belongs to
    hidden: torch.Tensor | None = None  # [NB, Q, block_size] bool: key hidden from that query (future, window, pad)


@dataclass(slots=True)
class _Plan:
    """How one step's requests are split between the two paths; built once, reused by every layer."""

    short: _ShortPlan | None
    long: list[_LongRequest]


class _Buffers:
    """Tensors kept across steps: `get(name, shape, dtype)` is a view of a persistent one, grown when a step needs
    more, so a step's plan allocates nothing once the batch sizes have been seen."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._store: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        buf = self._store.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._store[name] = torch.empty(max(numel, 64), dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def put(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in this store's device buffer `name` (a copy when it lives elsewhere)."""
        if tensor.device == self.device:
            return tensor
        return self.get(name, tuple(tensor.shape), tensor.dtype).copy_(tensor, non_blocking=True)


class TorchMetadataBuilder:
    """The torch backend's per-step planner (`AttentionMetadataBuilder`): the runner calls `build(meta)` once per
    step; the plan lands in `meta.scratch` where every layer's `forward` finds it."""

    def __init__(self, backend: TorchPagedAttention, block_size: int, device: torch.device | str) -> None:
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.host = _Buffers("cpu")
        self.dev = self.host if self.device.type == "cpu" else _Buffers(self.device)
        cache_dtype = backend.cache_dtype
        self.native = (self.device.type == "cpu" and backend.native is not False
                       and paged_attention_available(cache_dtype))

    def build(self, meta: AttentionMetadata) -> None:
        b = self.backend
        meta.scratch[b.plan_key(self.block_size)] = b.make_plan(meta, self.block_size, self.device, self.native,
                                                                self.host, self.dev)


class TorchPagedAttention:
    """The "torch" backend: see the module docstring for how the two paths split the work.

    `layer`: the layers' head counts, head dim, window and dtype (the engine's model passes it; `sliding_window`
    alone is enough where nobody asks for `kv_cache_spec`, as in direct tests). `kv_cache_dtype`: "auto",
    "int8" or "fp8" (module docstring). Options: `max_batched_query_len`: requests with at most this many query
    tokens take the batched path; longer ones use SDPA. `chunk_elements` bounds the K (or V) elements the torch
    path gathers at once. `native`: use the native CPU kernel for the short path (None: whenever it is
    available for the cache's dtype on CPU; False: always the torch path). `ops`: the engine's kernel-op table,
    given by the model (None: `KernelOps.reference()`, plain torch).
    """

    name = "torch"
    supports_tree_attention: ClassVar[bool] = True  # meta.tree_masks: honoured by both paths (torch ops, not native)
    kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto", "int8", "fp8")
    block_sizes: ClassVar[tuple[int, ...] | None] = None  # any power of two the manifest allows

    def __init__(self, *, layer: AttentionLayerSpec | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", max_batched_query_len: int = 8, chunk_elements: int = 1 << 24,
                 native: bool | None = None, ops: KernelOps | None = None) -> None:
        if layer is not None:
            sliding_window = layer.sliding_window
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        if kv_cache_dtype not in self.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the torch backend supports "
                             f"{', '.join(map(repr, self.kv_cache_dtypes))}")
        for key, value in (("max_batched_query_len", max_batched_query_len), ("chunk_elements", chunk_elements)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"[kernels] options.{key} must be a positive integer, got {value!r}")
        if native is not None and not isinstance(native, bool):
            raise ValueError(f"[kernels] options.native must be true or false, got {native!r}")
        self.layer = layer
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.max_batched_query_len = max_batched_query_len
        self.chunk_elements = chunk_elements
        self.native = native
        self.ops = ops if ops is not None else KernelOps.reference()

    def __repr__(self) -> str:
        return f"TorchPagedAttention(sliding_window={self.sliding_window}, kv_cache_dtype={self.kv_cache_dtype!r})"

    # --- the KV cache spec and the per-step builder ----------------------------------------

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        if self.layer is None:
            raise ValueError("TorchPagedAttention.kv_cache_spec needs the layer spec (construct it with layer=...)")
        return hnd_kv_cache_spec(self.layer, block_size, self.kv_cache_dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype K and V are stored in."""
        if self.kv_cache_dtype == "int8":
            return torch.int8
        if self.kv_cache_dtype == "fp8":
            return torch.float8_e4m3fn
        return self.layer.dtype if self.layer is not None else torch.float32

    def metadata_builder(self, block_size: int, device: torch.device | str) -> TorchMetadataBuilder:
        return TorchMetadataBuilder(self, block_size, device)

    def plan_key(self, block_size: int) -> str:
        return f"torch_paged:{self.max_batched_query_len}:{self.sliding_window}:{block_size}:{self.native}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D], caches: [num_blocks, Hkv, block_size, D]
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache[0].shape[1], kv_cache[0].shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self._write(kv_cache, k, v, meta)

        plan = self._plan(meta, block_size, q.device, kv_cache[0].dtype)
        short = plan.short
        if short is not None and short.tokens is None:
            # Every request is short, all of one length: q already is [B, Q, H, D], no gather needed.
            out = self._batched(q.view(short.num_requests, short.num_q, num_heads, head_dim), short, kv_cache, scale)
            return out.reshape(num_tokens, num_heads, head_dim)

        out = torch.empty_like(q)
        if short is not None:
            assert short.valid is not None
            res = self._batched(q[short.tokens], short, kv_cache, scale)  # [Bs, Q, H, D]
            rows = res.reshape(-1, num_heads, head_dim).index_select(0, short.valid)
            out.index_copy_(0, short.tokens.view(-1).index_select(0, short.valid), rows)
        for req in plan.long:
            out[req.token_start:req.token_end] = self._prefill(q[req.token_start:req.token_end], req, meta,
                                                               kv_cache, scale)
        return out

    # --- the quantized cache ----------------------------------------------------------------

    def _write(self, kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the step's K/V: as they are, or quantized with a scale per token and KV head."""
        if len(kv_cache) == 2:
            self.ops.write_kv(kv_cache, k, v, meta.slot_mapping, meta.scratch)
            return
        k_cache, v_cache, k_scale, v_scale = kv_cache
        kq, ks = quantize_kv(k, k_cache.dtype)
        vq, vs = quantize_kv(v, v_cache.dtype)
        # Copied as bytes: one-byte dtypes all copy alike (index_copy_ has no fp8 kernel on CPU).
        self.ops.write_kv((_bytes(k_cache), _bytes(v_cache)), _bytes(kq), _bytes(vq), meta.slot_mapping,
                          meta.scratch)
        self.ops.write_kv((k_scale.unsqueeze(-1), v_scale.unsqueeze(-1)), ks.unsqueeze(-1), vs.unsqueeze(-1),
                          meta.slot_mapping, meta.scratch)

    # --- planning -------------------------------------------------------------------------

    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device, cache_dtype: torch.dtype) -> _Plan:
        """The plan the metadata builder left in `meta.scratch`, or (called without one, as in direct tests) built
        now, once for the step, in fresh tensors."""
        key = self.plan_key(block_size)
        plan = meta.scratch.get(key)
        if plan is None:
            native = device.type == "cpu" and self.native is not False and paged_attention_available(cache_dtype)
            plan = meta.scratch[key] = self.make_plan(meta, block_size, device, native)
        return plan

    def _first_position(self, seq_len: int, query_len: int) -> int:
        """The earliest context position any of this request's queries can see."""
        if self.sliding_window is None:
            return 0
        return max(0, seq_len - query_len - self.sliding_window + 1)

    def make_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device, native: bool,
                  host: _Buffers | None = None, dev: _Buffers | None = None) -> _Plan:
        """The step's plan with tensor ops (no per-token Python). `host` / `dev`: the builder's persistent
        buffers (None: fresh tensors, for a plan built outside the builder)."""
        host = host or _Buffers("cpu")
        dev = dev or (host if device.type == "cpu" else _Buffers(device))
        native = native and not meta.tree_masks  # the native kernel masks by position only: trees take torch ops
        limit = self.max_batched_query_len
        if meta.max_query_len <= limit:  # every request short (every decode step): no split to compute
            if not meta.num_reqs:
                return _Plan(None, [])
            return _Plan(self._short_plan(None, meta.query_lens, meta.seq_lens_list, meta, block_size, device,
                                          native, host, dev), [])
        starts = [0]
        for q_len in meta.query_lens:  # per request, not per token
            starts.append(starts[-1] + q_len)
        rows = [i for i, q_len in enumerate(meta.query_lens) if q_len <= limit]
        long_reqs = [self._long_request(i, starts[i], meta, block_size, device)
                     for i, q_len in enumerate(meta.query_lens) if q_len > limit]
        short = None
        if rows:
            short = self._short_plan(rows, [meta.query_lens[i] for i in rows], [meta.seq_lens_list[i] for i in rows],
                                     meta, block_size, device, native, host, dev)
        return _Plan(short, long_reqs)

    def _short_plan(self, rows: list[int] | None, q_list: list[int], seq_list: list[int], meta: AttentionMetadata,
                    block_size: int, device: torch.device, native: bool, host: _Buffers,
                    dev: _Buffers) -> _ShortPlan:
        """The batched path's plan for the short requests `rows` (None: all of them) with those query and context
        lengths."""
        num_short, max_q = len(q_list), max(q_list)
        q_lens = torch.tensor(q_list, dtype=torch.int64)
        seq_lens = torch.tensor(seq_list, dtype=torch.int64)
        if self.sliding_window is not None:
            first = (seq_lens - q_lens - self.sliding_window + 1).clamp_min_(0) // block_size
        else:
            first = torch.zeros(num_short, dtype=torch.int64)
        ends = (seq_lens + block_size - 1) // block_size
        # Context position of every (padded) query; padding gets -1, which hides every key.
        q_pos = host.get("q_pos", (num_short, max_q), torch.int64)
        uniform = min(q_list) == max_q
        j = torch.arange(max_q)
        if uniform:  # no padding (a decode step: every query is its context's last position)
            torch.add((seq_lens - max_q)[:, None], j[None, :], out=q_pos)
        else:
            real = j[None, :] < q_lens[:, None]  # [Bs, Q]
            torch.where(real, (seq_lens - q_lens)[:, None] + j[None, :], torch.tensor(-1), out=q_pos)
        plan = _ShortPlan(tokens=None, valid=None, num_requests=num_short, num_q=max_q, q_pos=dev.put("q_pos", q_pos))
        rows_d = None if rows is None else dev.put("rows", torch.tensor(rows, dtype=torch.int64))
        if native:
            plan.tables = meta.block_tables if rows_d is None else meta.block_tables.index_select(0, rows_d)
            plan.first_block = first
            plan.end_block = ends
        else:
            # The ragged work list: entry e of request r reads block first[r] + (e - its first entry).
            counts = ends - first
            num_entries = int(counts.sum())
            owner = torch.repeat_interleave(torch.arange(num_short), counts, output_size=num_entries)
            entry_starts = torch.cumsum(counts, 0) - counts
            block_index = torch.arange(num_entries) - entry_starts[owner] + first[owner]  # [NB]
            owner_d = dev.put("owner", owner)
            plan.owner = owner_d
            table_rows = owner_d if rows_d is None else rows_d[owner_d]
            plan.blocks = meta.block_tables[table_rows, dev.put("block_index", block_index)].long()
            key_pos = block_index[:, None] * block_size + torch.arange(block_size)  # [NB, bs]
            entry_q = q_pos[owner][:, :, None]  # [NB, Q, 1]
            hidden = host.get("hidden", (num_entries, max_q, block_size), torch.bool)
            torch.gt(key_pos[:, None, :], entry_q, out=hidden)
            if self.sliding_window is not None:
                hidden |= key_pos[:, None, :] <= entry_q - self.sliding_window
            if meta.tree_masks:
                _hide_off_tree(hidden, meta.tree_masks, rows, q_list, seq_list, entry_starts, counts, key_pos,
                               self.sliding_window)
            plan.hidden = dev.put("hidden", hidden)
        if rows is None and uniform:
            return plan
        starts = torch.tensor(_first_tokens(meta, rows), dtype=torch.int64)  # [Bs]
        tokens = starts[:, None] + torch.minimum(j[None, :], q_lens[:, None] - 1)  # [Bs, Q]
        plan.tokens = dev.put("tokens", tokens)
        plan.valid = dev.put("valid", (j[None, :] < q_lens[:, None]).reshape(-1).nonzero().squeeze(1))
        return plan
        tokens = starts[:, None] + torch.minimum(j[None, :], q_lens[:, None] - 1)  # [Bs, Q]
        plan.tokens = dev.put("tokens", tokens)
        plan.valid = dev.put("valid", real.reshape(-1).nonzero().squeeze(1))
        return plan

    def _long_request(self, i: int, token_start: int, meta: AttentionMetadata, block_size: int,
                      device: torch.device) -> _LongRequest:
        q_len, seq_len = meta.query_lens[i], meta.seq_lens_list[i]
        first_block = self._first_position(seq_len, q_len) // block_size
        num_keys = seq_len - first_block * block_size
        mask = None
        window_matters = self.sliding_window is not None and self.sliding_window < seq_len
        if q_len != seq_len or window_matters:
            key_pos = first_block * block_size + torch.arange(num_keys, device=device)
            query_pos = seq_len - q_len + torch.arange(q_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if self.sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - self.sliding_window
        tree = meta.tree_masks.get(i)
        if tree is not None:  # within the query run: each draft node sees itself and its ancestors only
            key_pos = first_block * block_size + torch.arange(num_keys, device=device)
            query_pos = seq_len - q_len + torch.arange(q_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if self.sliding_window is not None:  # the window counts from the node's position, root + depth
                rope_pos = seq_len - q_len + tree.sum(1).to(device) - 1
                mask &= key_pos[None, :] > rope_pos[:, None] - self.sliding_window
            mask[:, num_keys - q_len:] &= tree.to(device)
        return _LongRequest(token_start, token_start + q_len, i, first_block, -(-seq_len // block_size),
                            num_keys, mask)

    # --- kernels --------------------------------------------------------------------------

    def _batched(self, q: torch.Tensor, plan: _ShortPlan, kv_cache: KVCache, scale: float) -> torch.Tensor:
        """Attention for [Bs, Q] padded queries over their ragged block lists; q: [Bs, Q, H, D] -> same shape."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if plan.tables is not None:
            assert plan.first_block is not None and plan.end_block is not None
            out = paged_attention(q, plan.q_pos, k_cache, v_cache, plan.tables, plan.first_block, plan.end_block,
                                  scale=scale, sliding_window=self.sliding_window)
            if out is not None:
                return out.to(q.dtype)
            raise MemoryError("the native paged-attention kernel could not allocate its scratch memory")
        assert plan.blocks is not None and plan.owner is not None and plan.hidden is not None
        num_reqs, num_q, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        rows = group * num_q
        num_entries = plan.blocks.numel()
        # [Bs, Hkv, G * Q, D] in float32, pre-scaled so the scores need no extra pass.
        qf = (q.view(num_reqs, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
              .reshape(num_reqs, num_kv_heads, rows, head_dim).float() * scale)
        step = max(1, self.chunk_elements // (num_kv_heads * block_size * head_dim))

        # Pass 1: scores of every entry, a bounded number of gathered K blocks at a time.
        scores = torch.empty(num_entries, num_kv_heads, rows, block_size, dtype=torch.float32, device=q.device)
        for c0 in range(0, num_entries, step):
            c1 = min(c0 + step, num_entries)
            keys = _gather(kv_cache, 0, plan.blocks[c0:c1])  # [n, Hkv, bs, D] float32
            torch.matmul(qf.index_select(0, plan.owner[c0:c1]), keys.transpose(-1, -2), out=scores[c0:c1])
        scores.view(num_entries, num_kv_heads, group, num_q, block_size).masked_fill_(
            plan.hidden[:, None, None], float("-inf"))

        # Exact softmax per request: its maximum over all of its entries, then sums per request.
        entry_max = scores.amax(-1)  # [NB, Hkv, G * Q]
        req_max = torch.full((num_reqs, num_kv_heads, rows), float("-inf"), device=q.device)
        req_max.scatter_reduce_(0, plan.owner[:, None, None].expand_as(entry_max), entry_max, "amax")
        # A row that sees nothing (a padding query) keeps max -inf; subtract 0 there so exp gives 0, not NaN.
        req_max.masked_fill_(req_max == float("-inf"), 0.0)
        probs = torch.exp(scores.sub_(req_max.index_select(0, plan.owner)[..., None]))
        denom = torch.zeros(num_reqs, num_kv_heads, rows, device=q.device).index_add_(0, plan.owner, probs.sum(-1))

        # Pass 2: probabilities times gathered V blocks, summed into each entry's request.
        out = torch.zeros(num_reqs, num_kv_heads, rows, head_dim, dtype=torch.float32, device=q.device)
        for c0 in range(0, num_entries, step):
            c1 = min(c0 + step, num_entries)
            values = _gather(kv_cache, 1, plan.blocks[c0:c1])  # [n, Hkv, bs, D] float32
            out.index_add_(0, plan.owner[c0:c1], torch.matmul(probs[c0:c1], values))
        out /= denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        out = out.view(num_reqs, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_reqs, num_q, num_heads, head_dim).to(q.dtype)

    def _prefill(self, q: torch.Tensor, req: _LongRequest, meta: AttentionMetadata, kv_cache: KVCache,
                 scale: float) -> torch.Tensor:
        """SDPA for one request's query run q [q_len, H, D] over its gathered context."""
        num_kv_heads, head_dim = kv_cache[0].shape[1], kv_cache[0].shape[3]
        blocks = meta.block_tables[req.request, req.first_block:req.end_block].long()

        def context(which: int) -> torch.Tensor:  # [1, Hkv, num_keys, D] in q's dtype
            if len(kv_cache) == 2:
                gathered = kv_cache[which].index_select(0, blocks).to(q.dtype)  # [n, Hkv, bs, D]
            else:
                gathered = _gather(kv_cache, which, blocks).to(q.dtype)
            return gathered.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[None, :, :req.num_keys]

        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), context(0), context(1),
            attn_mask=req.mask, is_causal=req.mask is None, scale=scale, enable_gqa=True,
        )  # [1, H, q_len, D]
        return out[0].transpose(0, 1)



def _hide_off_tree(hidden: torch.Tensor, tree_masks: dict[int, torch.Tensor], rows: list[int] | None,
                   q_list: list[int], seq_list: list[int], entry_starts: torch.Tensor, counts: torch.Tensor,
                   key_pos: torch.Tensor, window: int | None) -> None:
    """Hide, for each tree request of the short path, the keys of its query run that are not an ancestor of (or)
    the query: hidden [NB, Q, bs] (host), one request's entries at a time (a tree step has few). With a sliding
    window, a node's window counts from its own position (root + depth), not its slot's."""
    for r, batch_index in enumerate(range(len(q_list)) if rows is None else rows):
        tree = tree_masks.get(batch_index)
        if tree is None:
            continue
        q_len = q_list[r]
        first, n = int(entry_starts[r]), int(counts[r])
        rel = key_pos[first:first + n] - (seq_list[r] - q_len)  # [n, bs] offset of each key in the query run
        in_run = (rel >= 0) & (rel < q_len)
        off_tree = ~tree[:, rel.clamp(0, q_len - 1)]  # [q_len, n, bs]
        hide = in_run[:, None, :] & off_tree.transpose(0, 1)
        if window is not None:
            keys = key_pos[first:first + n, None, :]
            rope_pos = seq_list[r] - q_len + tree.sum(1) - 1  # [q_len]
            hide |= keys > (seq_list[r] - q_len + torch.arange(q_len))[None, :, None]  # causal, by slot
            hide |= keys <= (rope_pos - window)[None, :, None]
            hidden[first:first + n, :q_len] = hide
        else:
            hidden[first:first + n, :q_len] |= hide


def _first_tokens(meta: AttentionMetadata, rows: list[int] | None) -> list[int]:
    """The first token row of each request in `rows` (None: every request), one addition per request."""
    starts, total = [], 0
    for q_len in meta.query_lens:
        starts.append(total)
        total += q_len
    return starts if rows is None else [starts[i] for i in rows]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte-dtype tensor viewed as uint8 (int8 stays itself: its copies already work everywhere)."""
    return t if t.dtype == torch.int8 else t.view(torch.uint8)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (values in `dtype`, float32 scales [T, Hkv]) with x ~= values * scale per token and head."""
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(1e-12) / qmax  # [T, Hkv]
    scaled = xf / scale[..., None]
    if dtype == torch.int8:
        return scaled.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return scaled.clamp_(-qmax, qmax).to(dtype), scale


def _gather(kv_cache: KVCache, which: int, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks `blocks` of K (which=0) or V (1) in float32, dequantized when the cache holds scales."""
    cache = kv_cache[which]
    if len(kv_cache) == 2:
        return cache.index_select(0, blocks).float()
    values = _bytes(cache).index_select(0, blocks)
    if cache.dtype != torch.int8:
        values = values.view(cache.dtype)
    return values.float().mul_(kv_cache[2 + which].index_select(0, blocks).unsqueeze(-1))
