"""Mixtral: the Mistral decoder with a top-k routed mixture of SwiGLU experts in place of the MLP.

Experts are stored stacked, `gate_up_proj: [E, 2I, D]` and `down_proj: [E, D, I]` (the layout
transformers 5 uses in memory); the per-expert `w1`/`w3`/`w2` tensors of Mixtral checkpoints load
into their slices.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ember_platform.engine.models.layers import Linear, copy_weight, new_parameter
from ember_platform.engine.models.llama import MistralForCausalLM, ModelArgs, common_args, layer_windows

if TYPE_CHECKING:
    from ember_platform.engine.kernel_ops import KernelOps

_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*)\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<w>w[123])\.weight$")


class StackedExperts(nn.Module):
    """E SwiGLU experts in two stacked tensors; runs each token through the experts routed to it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: KernelOps) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.ops = ops
        self.gate_up_proj = new_parameter(num_experts, 2 * intermediate_size, hidden_size,
                                          weight_loader=self.gate_up_loader)
        self.down_proj = new_parameter(num_experts, hidden_size, intermediate_size, weight_loader=self.down_loader)

    def gate_up_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        """shard_id: None for the whole stack, or (expert, "gate" | "up") for one checkpoint w1 / w3."""
        if shard_id is None:
            copy_weight(param.data, loaded)
            return
        expert, part = shard_id  # type: ignore[misc]
        rows = param.data[expert].narrow(0, 0 if part == "gate" else self.intermediate_size, self.intermediate_size)
        copy_weight(rows, loaded)

    def down_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Hashable | None = None) -> None:
        """shard_id: None for the whole stack, or the expert index of one checkpoint w2."""
        copy_weight(param.data if shard_id is None else param.data[shard_id], loaded)

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        # x: [T, D]; top_ids: [T, k] expert ids; top_weights: [T, k] float32 routing weights
        top_k = top_ids.shape[1]
        out = torch.zeros_like(x)
        flat = top_ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // top_k
        weights = top_weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            idx = tokens[start:start + count]
            h = self.ops.silu_and_mul(F.linear(x[idx], self.gate_up_proj[expert]))  # [n, I]
            h = F.linear(h, self.down_proj[expert]) * weights[start:start + count, None]  # float32 like the router
            out.index_add_(0, idx, h.to(out.dtype))
            start += count
        return out


class MixtralMoE(nn.Module):
    """Router + experts: softmax over the router logits, keep the top k, renormalize them to sum to 1."""

    def __init__(self, args: ModelArgs, ops: KernelOps) -> None:
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = Linear(args.hidden_size, args.num_experts, ops=ops)
        self.experts = StackedExperts(args.num_experts, args.hidden_size, args.intermediate_size, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        top_weights /= top_weights.sum(dim=-1, keepdim=True)
        return self.experts(x, top_ids, top_weights)


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral: Mistral attention (optional sliding window) + MixtralMoE in every layer."""

    default_rope_theta: ClassVar[float] = 1_000_000.0
    # Attention only: the experts are stacked parameters, not linears (PEFT reaches them only through
    # target_parameters, which is not served), and LoRA on the router is not a thing adapters do.
    lora_module_names: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj")

    @classmethod
    def parse_args(cls, config: Mapping[str, Any]) -> ModelArgs:
        windows = layer_windows(config, [True] * config["num_hidden_layers"])
        return ModelArgs(**common_args(config, cls.default_rope_theta), sliding_windows=windows,
                         num_experts=config["num_local_experts"], num_experts_per_tok=config["num_experts_per_tok"])

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        return MixtralMoE(args, self.ops)

    def mlp_inputs(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.mlp.gate", f"{layer}.mlp.experts.gate_up_proj")  # the router, the stacked experts

    def mlp_outputs(self, layer: str) -> tuple[str, ...]:
        return (f"{layer}.mlp.experts.down_proj",)

    def checkpoint_target(self, name: str) -> tuple[str, Hashable | None] | None:
        match = _EXPERT_TENSOR.match(name)
        if match:
            prefix, expert, w = match["prefix"], int(match["expert"]), match["w"]
            if w == "w2":
                return f"{prefix}.mlp.experts.down_proj", expert
            return f"{prefix}.mlp.experts.gate_up_proj", (expert, "gate" if w == "w1" else "up")
        return super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))
