"""`medusa` speculation: k heads on the target's last hidden state draft k tokens at once (Cai et al., 2024).

Head i is a residual block `h + SiLU(W_i h + b_i)` whose output goes through the target's own LM head; it guesses
the token i + 1 places after the one the target samples from the same hidden state. So after each step the newest
kept hidden state of a request gives its next k drafts, with no extra pass of any model: the heads cost k small
matmuls plus k LM-head projections of one row per request.

The heads come from the package's `[speculator] model` directory (`config.json` + `medusa.safetensors`, made for
the example by `examples/train_medusa.py`). Heads trained on a draft vocabulary (`draft_vocab_size` in the config,
`draft_vocab` in the weights: the target ids of the tokens the target chooses most often, as EAGLE-3's) score only
those tokens, through the matching rows of the target's LM head, copied once: at batch 1 on a CPU the full LM head
read k times a step is the heads' main cost (4096 x 256 fp32 leaves the cache; 1024 rows stay in it). A token
outside it is never drafted; the target verifies every draft, so outputs are unchanged. Option `draft_vocab`
(`[speculator] options = {draft_vocab = false}`; default true when the heads carry one) scores the whole vocabulary
instead. Drafts are the heads' top-1 tokens, verified as a chain (the engine's
greedy check or rejection sampling, which keeps the target's distribution exactly: the drafts are deterministic,
so their proposal is the point mass).

Option `tree` (`[speculator] options = {tree = [3, 2, 1]}`): tree drafts verified in one pass with a tree
attention mask (the engine's spec_tree.py): the top-3 tokens of head 1, under each the top-2 of head 2, under each
of those the top-1 of head 3 (3 + 6 + 6 = 15 nodes); `len(tree)` heads are used. `num_speculative_tokens` is then
the node budget (at most that many nodes per step, so a step schedules 1 + budget tokens per request, as a chain of
that length would): each step's nodes are the tree's best by the heads' joint probability (the product of each
head's probability down the path, which never grows down a path, so the best nodes form a tree), best first, so
the adaptive length's smaller budgets keep the most promising nodes. It may not exceed the tree's node count.
Drafts never go deeper than the tokens a request may still generate (`max_tokens`).

Option `native_draft` (default: where it runs): on CPU in float32 with the native kernels built, the heads (all in
one linear: they share their input) and the draft-vocabulary rows run through `ember_kernels`' small-batch linears
(medusa_native.py) instead of torch's; `true` requires it (refused where it cannot run), `false` keeps the torch
ops. `native_draft_weights` (`int8`, the default: a scale per output row, W8A8 on a CPU with AVX512-VNNI;
`float32`): how those matrices are kept. In the engine, after the target's pass, the heads' float32 matrices come
from memory again each step: int8 made the heads' step 252 -> 85 us on the example (Medusa at batch 1 1.53-1.55x
-> 1.65-1.72x of no speculation, alternated runs). Drafts may differ from the float32 heads' at near-ties, outputs
never (the target verifies every draft).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ember_platform.api import Proposal, Speculator, SpeculatorContext, SpeculatorInputs
from ember_plugins.speculators.medusa_native import FORMATS, NativeMedusa
from ember_plugins.speculators.model_dir import read_model_config
from ember_plugins.speculators.native_options import native_draft_choice, native_kernel_blocker, refuse_if_required

WEIGHTS = "medusa.safetensors"


class MedusaHeads(nn.Module):
    """The heads' residual blocks: [n, D] hidden states -> [heads, n, D] inputs of the target's LM head."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.ModuleDict({"linear": nn.Linear(hidden_size, hidden_size)})
                                   for _ in range(num_heads))
        self.weight: torch.Tensor | None = None  # [heads, D, D] and [heads, 1, D] once packed
        self.bias: torch.Tensor | None = None

    def pack(self) -> None:
        """Stack the heads' weights into one tensor (each head's Linear keeps a view of its slice), so that forward
        runs every head as one batched matmul instead of a module call per head: at batch 1 on a CPU those calls
        cost more than the arithmetic (0.08 -> 0.03 ms for 3 heads of 256). Call after loading and moving."""
        self.weight = torch.stack([head["linear"].weight for head in self.heads])  # [heads, out, in]
        self.bias = torch.stack([head["linear"].bias for head in self.heads])[:, None]  # [heads, 1, out]
        for i, head in enumerate(self.heads):
            head["linear"].weight.data = self.weight[i]
            head["linear"].bias.data = self.bias[i, 0]

    def forward(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        if self.weight is None or self.bias is None:
            return torch.stack([hidden + nn.functional.silu(head["linear"](hidden))
                                for head in self.heads[:num_heads]])
        k = num_heads
        x = torch.baddbmm(self.bias[:k], hidden.expand(k, *hidden.shape), self.weight[:k].transpose(1, 2))
        return hidden + nn.functional.silu(x)


def _read_config(context: SpeculatorContext) -> dict[str, Any]:
    path, config = read_model_config(context, "medusa", "Medusa heads", "examples/train_medusa.py")
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


def _read_draft_vocab(value: Any, state: Mapping[str, torch.Tensor], config: Mapping[str, Any], path: Any,
                      vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary's target ids if the heads carry one and option `draft_vocab` does not turn it off."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"speculator.options.draft_vocab must be true or false (score only the heads' draft "
                         f"vocabulary, or the target's whole one), got {value!r}")
    vocab = state.get("draft_vocab")
    size = config.get("draft_vocab_size")
    if (vocab is None) != (size is None):
        raise ValueError(f"speculator.model: {path} and its config.json disagree on a draft vocabulary "
                         f"(draft_vocab_size {size!r}, draft_vocab tensor "
                         f"{'present' if vocab is not None else 'absent'})")
    if vocab is None:
        if value:
            raise ValueError(f"speculator.options.draft_vocab: the heads in {path} were trained on the whole "
                             "vocabulary (no draft_vocab); remove the option")
        return None
    if (vocab.dim() != 1 or vocab.dtype != torch.long or len(vocab) != int(size)
            or not bool(((vocab >= 0) & (vocab < vocab_size)).all()) or len(vocab.unique()) != len(vocab)):
        raise ValueError(f"speculator.model: {path}: draft_vocab must hold {size} distinct token ids in "
                         f"0..{vocab_size - 1}")
    return vocab if value is None or value else None


def _read_tree(value: Any, num_heads: int, budget: int) -> tuple[int, ...] | None:
    """The `tree` option: top-k per head, validated."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or not value
            or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in value)):
        raise ValueError(f"speculator.options.tree must be a non-empty list of positive integers (the top-k tokens "
                         f"of each head, e.g. [3, 2, 1]), got {value!r}")
    if len(value) > num_heads:
        raise ValueError(f"speculator.options.tree: {list(value)} needs {len(value)} Medusa heads; the heads' "
                         f"directory has {num_heads}")
    nodes = sum(_prefix_products(value))
    if nodes > 1024:
        raise ValueError(f"speculator.options.tree: {list(value)} has {nodes} nodes; at most 1024 are supported")
    if budget > nodes:
        raise ValueError(f"speculator.num_speculative_tokens: {budget} is the node budget of the tree "
                         f"(speculator.options.tree = {list(value)}), which has only {nodes} nodes")
    return tuple(int(k) for k in value)


def _prefix_products(tree: Sequence[int]) -> list[int]:
    out, n = [], 1
    for k in tree:
        n *= k
        out.append(n)
    return out


class _TreeTemplate:
    """Every node of a top-k-per-head tree as its path of ranks, shallowest first (parents before children)."""

    def __init__(self, tree: Sequence[int], device: torch.device) -> None:
        paths: list[tuple[int, ...]] = [()]
        nodes: list[tuple[int, ...]] = []
        for k in tree:
            paths = [(*p, r) for p in paths for r in range(k)]
            nodes += paths
        self.depth = len(tree)
        self.width = max(tree)
        index = {p: i for i, p in enumerate(nodes)}
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in nodes]
        # Column of each (node, depth) in the heads' top-k values flattened [depth * width]; past a node's depth,
        # a column of zeros (the last one) so that summing over depth gives the node's path score.
        pad = self.depth * self.width
        self.columns = torch.tensor([[d * self.width + r for d, r in enumerate(p)] + [pad] * (self.depth - len(p))
                                     for p in nodes], dtype=torch.long, device=device)  # [N, depth]
        self.last = torch.tensor([(len(p) - 1) * self.width + p[-1] for p in nodes], dtype=torch.long,
                                 device=device)  # [N]

    def __len__(self) -> int:
        return len(self.parents)


class MedusaSpeculator(Speculator):
    """Option `tree` (module docstring): top-k tokens per head as a tree of drafts; without it, a chain of top-1s."""

    uses_hidden_states = True
    sees_steps_without_drafts = False  # it reads only the steps it drafts for

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        super().__init__(options, context)
        config = _read_config(context)
        self.num_heads = int(config["num_heads"])
        self.tree = _read_tree(self.options.get("tree"), self.num_heads, context.num_speculative_tokens)
        self.drafts_trees = self.tree is not None
        self.template = _TreeTemplate(self.tree, context.device) if self.tree is not None else None
        if self.tree is None and context.num_speculative_tokens > self.num_heads:
            raise ValueError(f"speculator.num_speculative_tokens: {context.num_speculative_tokens} drafts need as "
                             f"many Medusa heads; {context.model_dir} has {self.num_heads}")
        target = context.target_model
        if target is None or not hasattr(target, "lm_head"):
            raise ValueError("medusa runs its heads through the target's LM head, which is not in this process "
                             "(a parallel strategy that keeps the model in other processes)")
        from safetensors.torch import load_file

        self.heads = MedusaHeads(self.num_heads, int(config["hidden_size"]))
        path = context.model_dir / WEIGHTS  # type: ignore[operator]
        state = load_file(str(path), device="cpu")
        vocab = _read_draft_vocab(self.options.get("draft_vocab"), state, config, path, context.vocab_size)
        state.pop("draft_vocab", None)
        missing, unexpected = self.heads.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"speculator.model: {context.model_dir / WEIGHTS} does not hold {self.num_heads} "
                             f"heads (missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.heads.to(device=context.device, dtype=context.dtype).eval().requires_grad_(False)
        self.heads.pack()
        self.lm_head = target.lm_head
        # Draft vocabulary: the LM head's rows for it, one [N, D] matrix (None: the whole LM head). A quantized LM
        # head keeps its own weight format; its rows are taken from what it computes for the identity.
        self.draft_vocab = vocab.to(context.device) if vocab is not None else None
        self.head_weight = self._head_rows(self.draft_vocab) if self.draft_vocab is not None else None
        self.native = self._native(*native_draft_choice(self.options, FORMATS))

    def _native(self, wanted: bool | None, weight_format: str) -> NativeMedusa | None:
        """The heads (and draft-vocabulary rows) through the native CPU linears (module docstring, option
        `native_draft`), or None for the torch ops."""
        if wanted is False:
            return None
        why = native_kernel_blocker(self.context, None, "ember_kernels.cpu.draft_weights", "packed_int8_available")
        if why is not None:
            refuse_if_required(wanted, why)
            return None
        assert self.heads.weight is not None and self.heads.bias is not None
        return NativeMedusa(self.heads.weight, self.heads.bias, self.head_weight, weight_format)

    def _head_states(self, newest: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[n, D] -> [num_heads, n, D]: the heads' outputs, inputs of the LM head."""
        return self.heads(newest, num_heads) if self.native is None else self.native.head_states(newest, num_heads)

    def _head_rows(self, vocab: torch.Tensor) -> torch.Tensor:
        weight = getattr(self.lm_head, "weight", None)
        dtype = self.context.dtype
        with torch.inference_mode():
            if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2:
                return weight.detach().index_select(0, vocab).to(dtype).contiguous()
            eye = torch.eye(int(self.heads.heads[0]["linear"].in_features), device=vocab.device, dtype=dtype)
            cols = self.lm_head(eye) - self.lm_head(torch.zeros_like(eye[:1]))  # [D, V]: a linear map's columns
            return cols.index_select(1, vocab).t().contiguous()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, V or N]: the LM head over the draft vocabulary if any (ids: `_ids`)."""
        if self.head_weight is None:
            return self.lm_head(x)
        if self.native is not None:
            return self.native.logits(x)
        return torch.nn.functional.linear(x, self.head_weight)

    def _ids(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def memory_bytes(self) -> int:
        rows = self.head_weight.numel() * self.head_weight.element_size() if self.head_weight is not None else 0
        native = self.native.memory_bytes() if self.native is not None else 0
        return rows + native + sum(p.numel() * p.element_size() for p in self.heads.parameters())

    @torch.inference_mode()
    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        if not inputs.propose_for:
            return []
        if inputs.hidden_states is None:
            raise ValueError("medusa needs the target's hidden states, and the step carries none")
        newest = inputs.hidden_states[inputs.last_rows()]  # [n, D]: each request's newest kept position
        if self.template is not None:
            return self._propose_tree(newest, inputs.num_speculative_tokens)
        k = min(inputs.num_speculative_tokens, self.num_heads)
        # The row's own prediction is the token the target just sampled; head i guesses the one i + 1 after it.
        states = self._head_states(newest, k).reshape(-1, newest.shape[-1])
        drafts = self._ids(self._logits(states).argmax(-1)).view(k, -1)
        return [Proposal(column) for column in drafts.t().tolist()]

    def _propose_tree(self, newest: torch.Tensor, budget: int) -> list[Proposal | None]:
        """The best `budget` nodes of the tree for each request (module docstring), best first."""
        template = self.template
        assert template is not None and self.tree is not None
        n, depth, width = newest.shape[0], template.depth, template.width
        logits = self._logits(self._head_states(newest, depth).reshape(-1, newest.shape[-1])).view(depth, n, -1)
        top = logits.float().log_softmax(-1).topk(width, dim=-1)  # [depth, n, width] log-probs and ids
        values = torch.cat([top.values.permute(1, 0, 2).reshape(n, -1), top.values.new_zeros(n, 1)], dim=1)
        ids = self._ids(top.indices.permute(1, 0, 2).reshape(n, -1))
        scores = values[:, template.columns].sum(-1)  # [n, N]: each node's path log-probability
        budget = min(budget, len(template))
        # Stable: a child never scores above its parent, and ties keep the shallower (earlier) node first.
        chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, :budget]  # [n, budget]
        tokens = ids[:, template.last].gather(1, chosen).tolist()
        proposals: list[Proposal | None] = []
        for nodes, toks in zip(chosen.tolist(), tokens, strict=True):
            where = {node: i for i, node in enumerate(nodes)}
            parents = [where[p] if p >= 0 else -1 for p in (template.parents[node] for node in nodes)]
            proposals.append(Proposal(toks, parents=parents))
        return proposals
