"""The draft model's drafting passes in few tensor ops: what makes a small draft model cheap enough to pay.

A one-token pass of the draft through the engine's model code costs what its ~25 module calls, kernel-op
dispatches, step metadata and attention plan cost, not what its arithmetic does: on the example's 2-layer,
width-128 draft it measured about half a pass of the 4-layer target. Drafting needs less than a general step:

* the context's K/V (positions 0..c - 1 of each request, in the draft's paged cache) does not change while a step
  drafts, so it is gathered once per step and layer into a dense buffer [B, Hkv, L, D], and every pass attends to
  that buffer with two batched matmuls and a position mask (no per-pass metadata, plan or block walk);
* the positions a step drafts at are guesses (the target's tokens replace them, and the next step's first pass
  recomputes them), so their K/V goes to the buffer only; the first pass's tokens (true tokens, held from then on)
  are also written to the paged cache at their slots;
* the weights are used as they are loaded (pre-transposed once for `torch.mm`), the norms, RoPE and SwiGLU as a few
  torch ops each, the same arithmetic as the engine's reference ops (transformers' Llama).

It runs any Llama-layout draft whose linears are full precision (`ChainDecoder.supports`); the plugin falls back to
the engine's model code otherwise, and for first passes longer than MAX_QUERY (a prompt the draft has not seen).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ember_platform.api import UNQUANTIZED, KVCache

KEEP_HEADROOM = 128  # positions a kept buffer (one request) is allocated past the step's
MAX_QUERY = 8  # first passes with more tokens per request than this run through the engine's model code


class _Layer:
    """One decoder layer's weights, as the passes use them ([in, out] for torch.mm)."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.qkv = attn.qkv_proj.weight.t().contiguous()
        self.qkv_bias = attn.qkv_proj.bias
        self.o = attn.o_proj.weight.t().contiguous()
        self.o_bias = attn.o_proj.bias
        self.gate_up = mlp.gate_up_proj.weight.t().contiguous()
        self.gate_up_bias = mlp.gate_up_proj.bias
        self.down = mlp.down_proj.weight.t().contiguous()
        self.down_bias = mlp.down_proj.bias


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


class ChainDecoder:
    """Runs a Llama-layout draft model's passes for one step (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        args = model.args
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.group = args.num_heads // args.num_kv_heads
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.layers = [_Layer(layer) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        self.norm_eps = model.model.norm.eps
        self.lm_head = model.lm_head.weight.t().contiguous()
        self.inv_freq = model.model.rotary_emb.inv_freq.to(self.embed.device)
        self.dtype = self.embed.dtype
        # The engine's kernel-op table, as the model's layers call it: the fused norm (with the residual add) and
        # SwiGLU, in-place RoPE (plain torch where no kernel takes the inputs). Linears stay torch.mm: a draft's
        # are small enough that a kernel call's fixed cost would dominate them.
        self.ops = model.ops
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.reset()

    @staticmethod
    def supports(model: Any) -> bool:
        """Whether this model's layers are the plain Llama decoder with full-precision linears."""
        try:
            layers = list(model.model.layers)
            linears = [model.lm_head] + [m for layer in layers for m in (
                layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            plain_mlp = all(type(layer.mlp).__name__ == "LlamaMLP" for layer in layers)
            return plain_mlp and all(getattr(m, "method", None) is UNQUANTIZED for m in linears) and all(
                w is None for w in model.args.sliding_windows)
        except AttributeError:
            return False

    # --- one step -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the kept buffer (the paged cache was rebound, or its request released)."""
        self._kept: tuple[str, list[int]] | None = None
        self._valid = 0

    def forget(self, request_id: str) -> None:
        if self._kept is not None and self._kept[0] == request_id:
            self.reset()

    def start(self, kv_caches: list[KVCache], tables: torch.Tensor, cached: list[int], length: int,
              keep: tuple[str, list[int]] | None = None) -> None:
        """Begin a step for B requests: request b's K/V at positions 0..cached[b] - 1 is in the paged caches at the
        blocks of tables[b] ([B, W] int32 on the device); the step's passes reach positions below `length`.

        `keep` (one request: its id and block list): the buffer stays for its next step, which then gathers nothing
        when it is the same request with the same blocks (a preemption gives it new ones) and the buffer already
        holds its first cached[0] positions (pass 1 writes the true tokens there as it writes them to the paged
        cache; the drafted positions past them are rewritten by the next pass 1, as in the paged cache)."""
        device = tables.device
        block_size = kv_caches[0][0].shape[2]
        batch = tables.shape[0]
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.rows = torch.arange(batch, device=device)
        # RoPE of every position the step's passes can reach, once: a pass indexes it.
        first = min(cached)
        freqs = torch.arange(first, length, device=device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_first = first
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        kept = self._kept
        if (keep is not None and kept is not None and batch == 1 and kept[0] == keep[0] and kept[1] is keep[1]
                and self._valid >= cached[0] and self.buffers[0][0].shape[2] >= length):
            self._valid = cached[0]
            return
        self._kept, self._valid = (keep, cached[0]) if batch == 1 else (None, 0)
        num_blocks = -(-max(cached) // block_size) if max(cached) else 0
        # A kept buffer has room for a few steps more before it is gathered anew.
        capacity = max(length + (KEEP_HEADROOM if keep is not None else 0), num_blocks * block_size)
        self.key_pos = torch.arange(capacity, device=device)
        self.buffers = []
        for k_cache, v_cache in ((c[0], c[1]) for c in kv_caches):
            pair = []
            for cache in (k_cache, v_cache):
                buf = torch.empty(batch, self.num_kv_heads, capacity, self.head_dim, dtype=cache.dtype, device=device)
                if num_blocks:
                    # [B, nb, Hkv, bs, D] -> [B, Hkv, nb * bs, D]: each request's context in position order
                    gathered = cache[tables[:, :num_blocks].long()]
                    buf[:, :, :num_blocks * block_size].copy_(gathered.transpose(1, 2).reshape(
                        batch, self.num_kv_heads, num_blocks * block_size, self.head_dim))
                # Zero what no pass has written yet: a masked key still meets its value in SDPA (weight 0 times
                # the value), and uninitialized memory can hold NaN, which 0 * NaN spreads to the whole row
                # (seen as drafts of token 0 in a batched first pass).
                buf[:, :, num_blocks * block_size:].zero_()
                pair.append(buf)
            self.buffers.append((pair[0], pair[1]))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: tuple[torch.Tensor, torch.Tensor,
                torch.Tensor] | None = None, first: int | None = None) -> torch.Tensor:
        """One pass of Q tokens per request: ids, positions [B, Q] (positions of the step, below its `length`; each
        query sees its request's keys at positions <= its own). `write_slots`: (rows of the flattened [B * Q]
        tokens, their batch index, their paged-cache slots) of the tokens whose K/V also goes to the paged cache.
        `first`: with one request, its first position (spares a device read). Returns float32 logits [B, Q, V]."""
        batch, q_len = ids.shape
        n = batch * q_len
        x = F.embedding(ids.reshape(-1), self.embed)  # [n, D]
        rope_rows = positions.reshape(-1) - self.rope_first
        cos, sin = self.cos[rope_rows], self.sin[rope_rows]  # [n, hd]
        if batch == 1:
            start = int(positions[0, 0]) if first is None else first
            end = start + q_len  # keys 0..end - 1: all a query may see, but for later ones of a longer run
            mask = None if q_len == 1 else (self.key_pos[None, :end] <= positions[0, :, None]).repeat(self.group, 1)
        else:
            end = self.key_pos.shape[0]
            visible = self.key_pos[None, None, :] <= positions[:, :, None]  # [B, Q, L]
            mask = visible[:, None].repeat(1, self.group, 1, 1).view(batch, 1, self.group * q_len, end)
        ops = self.ops
        h, residual = x, None
        for i, layer in enumerate(self.layers):
            h, residual = ops.rms_norm(h, layer.in_norm, layer.eps, residual)
            qkv = _linear(h, layer.qkv, layer.qkv_bias)
            qk = ops.rotary(qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads,
                                                                     self.head_dim), cos, sin)
            k = qk[:, self.num_heads:]  # [n, Hkv, D]
            v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
            k_buf, v_buf = self.buffers[i]
            if batch == 1:
                k_buf[0, :, start:end] = k.transpose(0, 1)
                v_buf[0, :, start:end] = v.transpose(0, 1)
            else:
                row_index = self.rows[:, None].expand(batch, q_len)
                k_buf.transpose(1, 2)[row_index, positions] = k.view(batch, q_len, self.num_kv_heads, self.head_dim)
                v_buf.transpose(1, 2)[row_index, positions] = v.view(batch, q_len, self.num_kv_heads, self.head_dim)
            if write_slots is not None:
                self._write_paged(i, k, v, write_slots)
                if batch == 1 and i == len(self.layers) - 1:
                    self._valid = max(self._valid, end)  # the true tokens' K/V, in every layer's buffer
            # Each KV head's G * Q queries ([B, Hkv, G * Q, D], G-major) against its keys [B, Hkv, end, D].
            q = qk[:, :self.num_heads].reshape(batch, q_len, self.num_kv_heads, self.group, self.head_dim)
            q = q.permute(0, 2, 3, 1, 4).reshape(batch, self.num_kv_heads, self.group * q_len, self.head_dim)
            out = F.scaled_dot_product_attention(q, k_buf[:, :, :end], v_buf[:, :, :end], attn_mask=mask,
                                                 scale=self.scale)
            out = out.view(batch, self.num_kv_heads, self.group, q_len, self.head_dim).permute(0, 3, 1, 2, 4)
            h = _linear(out.reshape(n, self.q_size), layer.o, layer.o_bias)
            h, residual = ops.rms_norm(h, layer.post_norm, layer.eps, residual)
            h = _linear(ops.silu_and_mul(_linear(h, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias)
        h, _ = ops.rms_norm(h, self.norm, self.norm_eps, residual)
        return torch.mm(h, self.lm_head).float().view(batch, q_len, -1)

    def _write_paged(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                     write_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The first pass's true tokens: their K/V at their slots of the paged cache (HND: block, head, offset)."""
        rows, _, slots = write_slots
        k_cache, v_cache = self.kv_caches[layer][0], self.kv_caches[layer][1]
        blocks, offsets = slots // self.block_size, slots % self.block_size
        k_cache[blocks, :, offsets] = k.index_select(0, rows).to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.index_select(0, rows).to(v_cache.dtype)
