"""`medusa` speculation: k heads on the target's last hidden state draft k tokens at once (Cai et al., 2024).

Head i is a residual block `h + SiLU(W_i h + b_i)` whose output goes through the target's own LM head; it guesses
the token i + 1 places after the one the target samples from the same hidden state. So after each step the newest
kept hidden state of a request gives its next k drafts, with no extra pass of any model: the heads cost k small
matmuls plus k LM-head projections of one row per request.

The heads come from the package's `[speculator] model` directory (`config.json` + `medusa.safetensors`, made for
the example by `examples/train_medusa.py`). Drafts are the heads' top-1 tokens, verified as a chain (the engine's
greedy check or rejection sampling, which keeps the target's distribution exactly: the drafts are deterministic,
so their proposal is the point mass). Tree verification (top-k per head) is not implemented yet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ember_platform.api import Proposal, Speculator, SpeculatorContext, SpeculatorInputs

CONFIG = "config.json"
WEIGHTS = "medusa.safetensors"


class MedusaHeads(nn.Module):
    """The heads' residual blocks: [n, D] hidden states -> [heads, n, D] inputs of the target's LM head."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.ModuleDict({"linear": nn.Linear(hidden_size, hidden_size)})
                                   for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        return torch.stack([hidden + nn.functional.silu(head["linear"](hidden)) for head in self.heads[:num_heads]])


def _read_config(context: SpeculatorContext) -> dict[str, Any]:
    if context.model_dir is None:
        raise ValueError("speculator.model: medusa needs the directory of its heads ([speculator] model = "
                         "\"speculator/medusa\", made by examples/train_medusa.py)")
    path = context.model_dir / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"speculator.model: cannot read the Medusa heads' {path}: {e}") from None
    if config.get("architecture") != "medusa" or not config.get("uses_target_lm_head"):
        raise ValueError(f"speculator.model: {path} does not describe Medusa heads on the target's LM head "
                         f"(architecture {config.get('architecture')!r})")
    target = context.target_config
    for key in ("hidden_size", "vocab_size"):
        if int(config.get(key, -1)) != int(target.get(key, -2)):
            raise ValueError(f"speculator.model: the Medusa heads in {context.model_dir} were trained for {key} "
                             f"{config.get(key)}, the model has {target.get(key)}")
    if int(config.get("num_layers", 1)) != 1:
        raise ValueError(f"speculator.model: {path}: num_layers {config.get('num_layers')} is not supported yet "
                         "(one residual block per head)")
    return config


class MedusaSpeculator(Speculator):
    """Takes no options yet (a `tree` of top-k drafts per head is refused, as any option is, until tree
    verification lands)."""

    uses_hidden_states = True

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        super().__init__(options, context)  # it reads no [speculator] options: Ember refuses any that are set
        config = _read_config(context)
        self.num_heads = int(config["num_heads"])
        if context.num_speculative_tokens > self.num_heads:
            raise ValueError(f"speculator.num_speculative_tokens: {context.num_speculative_tokens} drafts need as "
                             f"many Medusa heads; {context.model_dir} has {self.num_heads}")
        target = context.target_model
        if target is None or not hasattr(target, "lm_head"):
            raise ValueError("medusa runs its heads through the target's LM head, which is not in this process "
                             "(a parallel strategy that keeps the model in other processes)")
        from safetensors.torch import load_file

        self.heads = MedusaHeads(self.num_heads, int(config["hidden_size"]))
        state = load_file(str(context.model_dir / WEIGHTS), device="cpu")  # type: ignore[operator]
        missing, unexpected = self.heads.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"speculator.model: {context.model_dir / WEIGHTS} does not hold {self.num_heads} "
                             f"heads (missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.heads.to(device=context.device, dtype=context.dtype).eval().requires_grad_(False)
        self.lm_head = target.lm_head

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.heads.parameters())

    @torch.inference_mode()
    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        if not inputs.propose_for:
            return []
        if inputs.hidden_states is None:
            raise ValueError("medusa needs the target's hidden states, and the step carries none")
        k = min(inputs.num_speculative_tokens, self.num_heads)
        newest = inputs.hidden_states[inputs.last_rows()]  # [n, D]: each request's newest kept position
        # The row's own prediction is the token the target just sampled; head i guesses the one i + 1 after it.
        drafts = self.lm_head(self.heads(newest, k).reshape(-1, newest.shape[-1])).argmax(-1).view(k, -1)
        return [Proposal(column) for column in drafts.t().tolist()]
