"""Paged attention in plain PyTorch, for CPU and CUDA: the portable "torch" backend.

Requests with short query runs (decode, speculative 1 + k tokens) go through one batched kernel
that reads the cache a chunk of blocks at a time through the block tables, for all requests at
once, and merges chunks with an online softmax in float32 (flash-decoding style): no request's
context is ever copied out whole. Requests with long query runs (prefill chunks) are few per step
and compute-bound, so each gathers its own context once and runs SDPA with an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember_platform.engine.attention import AttentionMetadata, KVCache


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
class _Plan:
    """How one step's requests are split between the two paths; built once, reused by every layer."""

    short_rows: torch.Tensor | None  # [Bs] request indices; None: every request, in order
    short_tokens: torch.Tensor | None  # [Bs, Q] token index per padded query; None: q already is [B, Q]
    short_pos: torch.Tensor | None  # [Bs, Q] context position of each query, -1 for padding
    short_valid: torch.Tensor | None  # [Bs * Q] rows of the padded result that are real tokens
    short_first_block: int
    short_end_block: int
    long: list[_LongRequest]


class TorchPagedAttention:
    """The "torch" backend: see the module docstring for how the two paths split the work.

    `max_batched_query_len`: requests with at most this many query tokens share the batched
    chunked kernel; longer ones use SDPA. `chunk_elements` bounds the K/V elements gathered per
    chunk (batch x tokens x heads x dim), `max_blocks_per_chunk` the blocks per chunk.
    """

    name = "torch"

    def __init__(self, *, sliding_window: int | None = None, max_batched_query_len: int = 8,
                 chunk_elements: int = 1 << 24, max_blocks_per_chunk: int = 32) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.sliding_window = sliding_window
        self.max_batched_query_len = max_batched_query_len
        self.chunk_elements = chunk_elements
        self.max_blocks_per_chunk = max_blocks_per_chunk

    def __repr__(self) -> str:
        return f"TorchPagedAttention(sliding_window={self.sliding_window})"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D], caches: [num_blocks, block_size, Hkv, D]
        k_cache, v_cache = kv_cache
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

        plan = self._plan(meta, block_size, q.device)
        if plan.short_pos is not None and plan.short_tokens is None:
            # Every request is short, all of one length: q already is [B, Q, H, D], no gather needed.
            batched_q = q.view(meta.num_reqs, -1, num_heads, head_dim)
            out = self._chunked(batched_q, plan.short_pos, meta.block_tables, kv_cache, scale,
                                plan.short_first_block, plan.short_end_block)
            return out.reshape(num_tokens, num_heads, head_dim)

        out = torch.empty_like(q)
        if plan.short_pos is not None:
            assert plan.short_tokens is not None and plan.short_valid is not None and plan.short_rows is not None
            batched_q = q[plan.short_tokens]  # [Bs, Q, H, D]
            tables = meta.block_tables.index_select(0, plan.short_rows)
            res = self._chunked(batched_q, plan.short_pos, tables, kv_cache, scale,
                                plan.short_first_block, plan.short_end_block)
            rows = res.reshape(-1, num_heads, head_dim).index_select(0, plan.short_valid)
            out.index_copy_(0, plan.short_tokens.view(-1).index_select(0, plan.short_valid), rows)
        for req in plan.long:
            out[req.token_start:req.token_end] = self._prefill(q[req.token_start:req.token_end], req, meta,
                                                               kv_cache, scale)
        return out

    # --- planning -------------------------------------------------------------------------

    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
        key = f"torch_paged:{self.max_batched_query_len}:{self.sliding_window}:{block_size}"
        plan = meta.scratch.get(key)
        if plan is None:
            plan = meta.scratch[key] = self._make_plan(meta, block_size, device)
        return plan

    def _first_position(self, seq_len: int, query_len: int) -> int:
        """The earliest context position any of this request's queries can see."""
        if self.sliding_window is None:
            return 0
        return max(0, seq_len - query_len - self.sliding_window + 1)

    def _make_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
        starts = [0]
        for q_len in meta.query_lens:
            starts.append(starts[-1] + q_len)
        short = [i for i, q_len in enumerate(meta.query_lens) if q_len <= self.max_batched_query_len]
        long_reqs = [self._long_request(i, starts[i], meta, block_size, device)
                     for i, q_len in enumerate(meta.query_lens) if q_len > self.max_batched_query_len]
        if not short:
            return _Plan(None, None, None, None, 0, 0, long_reqs)

        first_block = min(self._first_position(meta.seq_lens_list[i], meta.query_lens[i]) for i in short) // block_size
        end_block = -(-max(meta.seq_lens_list[i] for i in short) // block_size)
        max_q = max(meta.query_lens[i] for i in short)
        uniform = len(short) == meta.num_reqs and all(q_len == max_q for q_len in meta.query_lens)
        # Context position of every (padded) query; padding gets -1, which masks every key out.
        positions = [[meta.seq_lens_list[i] - meta.query_lens[i] + j if j < meta.query_lens[i] else -1
                      for j in range(max_q)] for i in short]
        short_pos = torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True)
        if uniform:
            return _Plan(None, None, short_pos, None, first_block, end_block, long_reqs)
        tokens = [[starts[i] + min(j, meta.query_lens[i] - 1) for j in range(max_q)] for i in short]
        valid = [r * max_q + j for r, i in enumerate(short) for j in range(meta.query_lens[i])]
        return _Plan(
            short_rows=torch.tensor(short, dtype=torch.int64).to(device, non_blocking=True),
            short_tokens=torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True),
            short_pos=short_pos,
            short_valid=torch.tensor(valid, dtype=torch.int64).to(device, non_blocking=True),
            short_first_block=first_block,
            short_end_block=end_block,
            long=long_reqs,
        )

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

    def _chunked(self, q: torch.Tensor, q_pos: torch.Tensor, block_tables: torch.Tensor, kv_cache: KVCache,
                 scale: float, first_block: int, end_block: int) -> torch.Tensor:
        """Attention for [B, Q] padded queries over blocks [first_block, end_block) of each table.

        q: [B, Q, H, D]; q_pos: [B, Q] context positions (-1: padding); returns [B, Q, H, D].
        """
        k_cache, v_cache = kv_cache
        batch, num_q, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        rows = group * num_q
        # [B, Hkv, G * Q, D] in float32, pre-scaled so the scores need no extra pass.
        qf = (q.view(batch, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
              .reshape(batch, num_kv_heads, rows, head_dim).float() * scale)
        acc = torch.zeros(batch, num_kv_heads, rows, head_dim, dtype=torch.float32, device=q.device)
        run_max = torch.full((batch, num_kv_heads, rows), float("-inf"), dtype=torch.float32, device=q.device)
        run_sum = torch.zeros(batch, num_kv_heads, rows, dtype=torch.float32, device=q.device)
        end_block = min(end_block, block_tables.shape[1])
        per_block = batch * block_size * num_kv_heads * head_dim
        step = max(1, min(self.max_blocks_per_chunk, self.chunk_elements // per_block))
        for c0 in range(first_block, end_block, step):
            blocks = block_tables[:, c0:min(c0 + step, end_block)].reshape(-1).long()  # [B * n]
            num_keys = blocks.numel() // batch * block_size
            # Gather this chunk for all requests at once: [B, N, Hkv, D], one contiguous copy each.
            kc = k_cache.index_select(0, blocks).view(batch, num_keys, num_kv_heads, head_dim).float()
            vc = v_cache.index_select(0, blocks).view(batch, num_keys, num_kv_heads, head_dim).float()
            # One bmm per KV head reads its [B, N, D] slice in place (rows strided by Hkv * D), where a
            # single batched matmul over (B, Hkv) would first copy the chunk into head-major order.
            scores = torch.stack([torch.bmm(qf[:, h], kc[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)],
                                 dim=1)  # [B, Hkv, G * Q, N]
            key_pos = c0 * block_size + torch.arange(num_keys, device=q.device)
            visible = key_pos <= q_pos[..., None]  # [B, Q, N]; also hides padding queries and the cache tail
            if self.sliding_window is not None:
                visible &= key_pos > q_pos[..., None] - self.sliding_window
            scores = scores.view(batch, num_kv_heads, group, num_q, num_keys)
            scores.masked_fill_(~visible[:, None, None], float("-inf"))
            scores = scores.view(batch, num_kv_heads, rows, num_keys)

            new_max = torch.maximum(run_max, scores.amax(-1))
            # A row with nothing visible yet keeps max -inf; subtract 0 there so exp gives 0, not NaN.
            safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = torch.exp(scores - safe_max[..., None])
            correction = torch.exp(run_max - safe_max)
            run_sum = run_sum * correction + probs.sum(-1)
            pv = torch.stack([torch.bmm(probs[:, h], vc[:, :, h]) for h in range(num_kv_heads)], dim=1)
            acc = acc * correction[..., None] + pv  # [B, Hkv, G * Q, D]
            run_max = new_max
        out = acc / run_sum.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        out = out.view(batch, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
        return out.reshape(batch, num_q, num_heads, head_dim).to(q.dtype)

    def _prefill(self, q: torch.Tensor, req: _LongRequest, meta: AttentionMetadata, kv_cache: KVCache,
                 scale: float) -> torch.Tensor:
        """SDPA for one request's query run q [q_len, H, D] over its gathered context."""
        k_cache, v_cache = kv_cache
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        blocks = meta.block_tables[req.request, req.first_block:req.end_block].long()
        keys = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:req.num_keys].to(q.dtype)
        values = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:req.num_keys].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=req.mask, is_causal=req.mask is None, scale=scale, enable_gqa=True,
        )  # [1, H, q_len, D]
        return out[0].transpose(0, 1)
