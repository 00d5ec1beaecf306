"""Runs the model for one scheduled batch: flatten the requests' new tokens, build the paged-
attention metadata (and the LoRA token -> adapter slot index), run the forward pass, and return
logits only where tokens are sampled."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember_platform.engine.attention import AttentionMetadata, KVCache, kv_cache_block_shape
from ember_platform.engine.lora_manager import LoRAManager
from ember_platform.engine.request import Request
from ember_platform.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class ForwardResult:
    """Logits for the requests that reached the end of their known tokens this step.

    `logits` rows are grouped by request in `sampled` order: request i owns `num_rows[i]` rows
    (1 + its number of speculative tokens); `hidden` holds the matching hidden states.
    """

    sampled: list[Request]
    num_rows: list[int]
    logits: torch.Tensor  # [N, V] float32
    hidden: torch.Tensor  # [N, D]


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    # zeros, not empty: backends may read (masked) slots past a sequence's end; NaN * 0 = NaN.
    shape = (num_blocks, *kv_cache_block_shape(block_size, num_kv_heads, head_dim))
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, device: torch.device,
                 lora: LoRAManager | None = None) -> None:
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ForwardResult:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        sample_index: list[int] = []
        sampled: list[Request] = []
        num_rows: list[int] = []
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            start = req.num_computed_tokens
            offset = len(input_ids)
            known = req.num_tokens
            for pos in range(start, start + n):
                input_ids.append(req.token_at(pos) if pos < known else req.spec_token_ids[pos - known])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(req.block_ids)
            if start + n >= known:  # reaches the newest token: sample (and verify any drafts)
                first = known - 1 - start
                sample_index.extend(range(offset + first, offset + n))
                sampled.append(req)
                num_rows.append(n - first)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.lora is not None:  # one token -> slot index per step, shared by every LoRA layer
            self.lora.begin_step(batch.requests, batch.num_tokens)
        try:
            hidden = self.model(ids, pos, meta, self.kv_caches)  # [T, D]
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if sample_index:
            picked = hidden[torch.tensor(sample_index, dtype=torch.long, device=self.device)]
        else:
            picked = hidden[:0]
        logits = self.model.compute_logits(picked) if sample_index else hidden.new_zeros((0, 0)).float()
        return ForwardResult(sampled, num_rows, logits, picked)
