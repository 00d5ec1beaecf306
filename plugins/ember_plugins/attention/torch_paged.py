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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember_kernels.cpu import paged_attention, paged_attention_available
from ember_platform.api import AttentionMetadata, KernelOps, KVCache


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


class TorchPagedAttention:
    """The "torch" backend: see the module docstring for how the two paths split the work.

    `max_batched_query_len`: requests with at most this many query tokens take the batched
    path; longer ones use SDPA. `chunk_elements` bounds the K (or V) elements the torch path
    gathers at once. `native`: use the native CPU kernel for the short path (None: whenever it is
    available for the cache's dtype on CPU; False: always the torch path). `ops`: the engine's kernel-op table,
    given by the model (None: `KernelOps.reference()`, plain torch).
    """

    name = "torch"

    def __init__(self, *, sliding_window: int | None = None, max_batched_query_len: int = 8,
                 chunk_elements: int = 1 << 24, native: bool | None = None, ops: KernelOps | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.sliding_window = sliding_window
        self.max_batched_query_len = max_batched_query_len
        self.chunk_elements = chunk_elements
        self.native = native
        self.ops = ops if ops is not None else KernelOps.reference()

    def __repr__(self) -> str:
        return f"TorchPagedAttention(sliding_window={self.sliding_window})"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D], caches: [num_blocks, Hkv, block_size, D]
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_cache[0].shape[1], kv_cache[0].shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        self.ops.write_kv(kv_cache, k, v, meta.slot_mapping, meta.scratch)

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

    # --- planning -------------------------------------------------------------------------

    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device, cache_dtype: torch.dtype) -> _Plan:
        key = f"torch_paged:{self.max_batched_query_len}:{self.sliding_window}:{block_size}:{self.native}"
        plan = meta.scratch.get(key)
        if plan is None:
            native = device.type == "cpu" and self.native is not False and paged_attention_available(cache_dtype)
            plan = meta.scratch[key] = self._make_plan(meta, block_size, device, native)
        return plan

    def _first_position(self, seq_len: int, query_len: int) -> int:
        """The earliest context position any of this request's queries can see."""
        if self.sliding_window is None:
            return 0
        return max(0, seq_len - query_len - self.sliding_window + 1)

    def _make_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device, native: bool) -> _Plan:
        starts = [0]
        for q_len in meta.query_lens:
            starts.append(starts[-1] + q_len)
        short = [i for i, q_len in enumerate(meta.query_lens) if q_len <= self.max_batched_query_len]
        long_reqs = [self._long_request(i, starts[i], meta, block_size, device)
                     for i, q_len in enumerate(meta.query_lens) if q_len > self.max_batched_query_len]
        return _Plan(self._short_plan(short, starts, meta, block_size, device, native) if short else None,
                     long_reqs)

    def _short_plan(self, short: list[int], starts: list[int], meta: AttentionMetadata, block_size: int,
                    device: torch.device, native: bool) -> _ShortPlan:
        q_lens = [meta.query_lens[i] for i in short]
        seq_lens = [meta.seq_lens_list[i] for i in short]
        max_q = max(q_lens)
        first = [self._first_position(s, q) // block_size for s, q in zip(seq_lens, q_lens, strict=True)]
        ends = [-(-s // block_size) for s in seq_lens]
        # Context position of every (padded) query; padding gets -1, which hides every key.
        q_pos = torch.tensor([[s - q + j if j < q else -1 for j in range(max_q)]
                              for s, q in zip(seq_lens, q_lens, strict=True)], dtype=torch.int64)  # [Bs, Q]
        rows = torch.tensor(short, dtype=torch.int64).to(device, non_blocking=True)
        plan = _ShortPlan(tokens=None, valid=None, num_requests=len(short), num_q=max_q,
                          q_pos=q_pos.to(device, non_blocking=True))
        if native:
            plan.tables = meta.block_tables.index_select(0, rows).int()
            plan.first_block = torch.tensor(first, dtype=torch.int64)
            plan.end_block = torch.tensor(ends, dtype=torch.int64)
        else:
            # The ragged work list, built with tensor ops: entry j of request r reads block first[r] + j.
            counts = torch.tensor(ends, dtype=torch.int64) - torch.tensor(first, dtype=torch.int64)
            owner = torch.repeat_interleave(torch.arange(len(short)), counts)
            entry_starts = torch.cumsum(counts, 0) - counts
            block_index = torch.arange(owner.numel()) - entry_starts[owner] + torch.tensor(first)[owner]  # [NB]
            owner_d = owner.to(device, non_blocking=True)
            plan.owner = owner_d
            plan.blocks = meta.block_tables[rows[owner_d], block_index.to(device, non_blocking=True)].long()
            key_pos = block_index[:, None] * block_size + torch.arange(block_size)  # [NB, bs]
            entry_q = q_pos[owner][:, :, None]  # [NB, Q, 1]
            hidden = key_pos[:, None, :] > entry_q
            if self.sliding_window is not None:
                hidden |= key_pos[:, None, :] <= entry_q - self.sliding_window
            plan.hidden = hidden.to(device, non_blocking=True)
        if len(short) == meta.num_reqs and all(q == max_q for q in q_lens):
            return plan
        tokens = [[starts[i] + min(j, meta.query_lens[i] - 1) for j in range(max_q)] for i in short]
        valid = [r * max_q + j for r, q in enumerate(q_lens) for j in range(q)]
        plan.tokens = torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True)
        plan.valid = torch.tensor(valid, dtype=torch.int64).to(device, non_blocking=True)
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
        return _LongRequest(token_start, token_start + q_len, i, first_block, -(-seq_len // block_size),
                            num_keys, mask)

    # --- kernels --------------------------------------------------------------------------

    def _batched(self, q: torch.Tensor, plan: _ShortPlan, kv_cache: KVCache, scale: float) -> torch.Tensor:
        """Attention for [Bs, Q] padded queries over their ragged block lists; q: [Bs, Q, H, D] -> same shape."""
        k_cache, v_cache = kv_cache
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
            keys = k_cache.index_select(0, plan.blocks[c0:c1]).float()  # [n, Hkv, bs, D]
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
            values = v_cache.index_select(0, plan.blocks[c0:c1]).float()  # [n, Hkv, bs, D]
            out.index_add_(0, plan.owner[c0:c1], torch.matmul(probs[c0:c1], values))
        out /= denom.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        out = out.view(num_reqs, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(num_reqs, num_q, num_heads, head_dim).to(q.dtype)

    def _prefill(self, q: torch.Tensor, req: _LongRequest, meta: AttentionMetadata, kv_cache: KVCache,
                 scale: float) -> torch.Tensor:
        """SDPA for one request's query run q [q_len, H, D] over its gathered context."""
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
        blocks = meta.block_tables[req.request, req.first_block:req.end_block].long()

        def context(cache: torch.Tensor) -> torch.Tensor:  # [1, Hkv, num_keys, D] in q's dtype
            gathered = cache.index_select(0, blocks).to(q.dtype)  # [n, Hkv, bs, D]
            return gathered.transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[None, :, :req.num_keys]

        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), context(k_cache), context(v_cache),
            attn_mask=req.mask, is_causal=req.mask is None, scale=scale, enable_gqa=True,
        )  # [1, H, q_len, D]
        return out[0].transpose(0, 1)
