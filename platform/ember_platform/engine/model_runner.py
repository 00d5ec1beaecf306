"""Runs the model for one `StepPlan` on a worker's device: the paged-attention metadata (built once per step
from the plan's tensors), the LoRA token -> slot index, the forward pass, and logits only where tokens are
sampled; plus the hidden states a speculator asked for."""

from __future__ import annotations

import torch
from torch import nn

from ember_platform.engine.attention import AttentionMetadata, KVCache, kv_cache_block_shape
from ember_platform.engine.lora_manager import LoRAManager
from ember_platform.engine.step_plan import StepOutput, StepPlan


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    # zeros, not empty: backends may read (masked) slots past a sequence's end; NaN * 0 = NaN.
    shape = (num_blocks, *kv_cache_block_shape(block_size, num_kv_heads, head_dim))
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def plan_metadata(plan: StepPlan, block_size: int, device: torch.device) -> AttentionMetadata:
    """The step's attention metadata from the plan's tensors: new tokens' slots are looked up in the block
    tables by (request, position) for all T tokens at once."""
    lens = torch.tensor(plan.query_lens, dtype=torch.long)
    token_req = torch.repeat_interleave(torch.arange(plan.num_reqs), lens, output_size=plan.num_tokens)
    positions = plan.positions
    if plan.num_tokens and int(positions.max()) >= plan.block_tables.shape[1] * block_size:
        raise ValueError(f"a block table of {plan.block_tables.shape[1]} blocks of {block_size} cannot hold "
                         f"position {int(positions.max())}")
    blocks = plan.block_tables[token_req, positions // block_size].long()
    starts = torch.zeros(plan.num_reqs + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=starts[1:])
    return AttentionMetadata(
        slot_mapping=_to(blocks * block_size + positions % block_size, device),
        query_start_loc=_to(starts, device),
        seq_lens=_to(torch.tensor(plan.seq_lens, dtype=torch.long), device),
        block_tables=_to(plan.block_tables, device),
        query_lens=list(plan.query_lens),
        seq_lens_list=list(plan.seq_lens),
        max_query_len=max(plan.query_lens, default=0),
        max_seq_len=max(plan.seq_lens, default=0),
        decode_only=all(q == 1 for q in plan.query_lens),
        tree_masks=_tree_masks(plan),
    )


def _tree_masks(plan: StepPlan) -> dict[int, torch.Tensor]:
    if not plan.trees:
        return {}
    from ember_platform.engine.spec_tree import ancestor_mask

    return {i: ancestor_mask(parents) for i, parents in plan.trees}


def move_kv(kv_caches: list[KVCache], src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
    """Copy the KV entries of slots `src` into slots `dst` ([n] int64, block_id * block_size + offset) in every
    layer's cache tensors (the "HND" layout: dim 2 is the offset in the block; scales `[blocks, Hkv, bs]` too)."""
    blocks_src, offsets_src = src // block_size, src % block_size
    blocks_dst, offsets_dst = dst // block_size, dst % block_size
    for cache in kv_caches:
        for t in cache:
            if t.element_size() == 1 and t.dtype not in (torch.int8, torch.uint8):
                t = t.view(torch.uint8)  # fp8: indexing kernels copy bytes alike
            values = t[blocks_src, :, offsets_src]  # [n, Hkv, ...]: gathered first, so overlapping moves are safe
            t[blocks_dst, :, offsets_dst] = values


class ModelRunner:
    """Executes plans on one model and its KV caches (a worker owns one)."""

    def __init__(self, model: nn.Module, kv_caches: list[KVCache], block_size: int, device: torch.device,
                 lora: LoRAManager | None = None) -> None:
        self.model = model
        self.lora = lora
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        # Each distinct backend's per-step planner (AttentionMetadataBuilder), run once per step, not per layer.
        backends = {id(b): b for b in getattr(model, "attention_backends", ())}.values()
        self.attention_builders = [builder for b in backends if hasattr(b, "metadata_builder")
                                   and (builder := b.metadata_builder(block_size, device)) is not None]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        meta = plan_metadata(plan, self.block_size, self.device)
        for builder in self.attention_builders:
            builder.build(meta)
        ids = _to(plan.input_ids, self.device)
        pos = _to(plan.positions if plan.rope_positions is None else plan.rope_positions, self.device)
        aux: dict[int, torch.Tensor] | None = dict.fromkeys(plan.aux_layers) if plan.aux_layers else None
        if self.lora is not None:  # one token -> slot index per step, shared by every LoRA layer
            self.lora.begin_step(plan.lora_names, plan.query_lens)
        try:
            if aux is None:
                hidden = self.model(ids, pos, meta, self.kv_caches)  # [T, D]
            else:
                hidden = self.model(ids, pos, meta, self.kv_caches, aux_hidden=aux)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if aux is not None and any(v is None for v in aux.values()):
            raise RuntimeError(f"{type(self.model).__name__} filled no hidden states for layers "
                               f"{[i for i, v in aux.items() if v is None]} (its forward ignores aux_hidden)")
        if plan.sample_rows.numel():
            logits = self.model.compute_logits(hidden[_to(plan.sample_rows, self.device)])
        else:
            logits = hidden.new_zeros((0, 0)).float()
        return StepOutput(logits, hidden if plan.return_hidden_states else None, aux or {})

    @torch.inference_mode()
    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy KV slots `src` to `dst` in every layer (an accepted tree path moved to consecutive positions)."""
        if src:
            move_kv(self.kv_caches, torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device),
                    self.block_size)
