"""`eagle3` speculation: a one-layer draft transformer on the fusion of the target's low, middle and high hidden
states drafts k tokens autoregressively (EAGLE-3, Li et al., 2025). The head is `eagle3_model.Eagle3Draft`.

Features: the residual stream entering layers `(1, n // 2, n - 1)` of the target's n (`aux_layers`; for the
example's 4 layers 1, 2, 3: the outputs of its first three layers), which the engine returns for every scheduled
token. Embeddings and LM head are the target's own (the head's directory holds neither): the head stays ~1M
parameters on the example. Its logits are the target's LM head's rows for the head's draft vocabulary (the target's
most frequent choices, `draft_vocab` in its weights, as in EAGLE-3: 1024 of the example's 4096 tokens), copied once,
so each draft position projects onto N rows, not V; tokens outside it are never drafted.

Each step, for every request of the batch (prompt chunks included; only those it drafts for where they are under
half of the batch, e.g. the length chooser's probes), the head first *catches up* over the step's kept tokens: row p
pairs the target's fused features at p with the embedding of the token at p + 1 (the one the target chose from
them), and its K/V are written to the head's own paged KV cache (`kv_cache_spec`: one layer, the target's KV heads
and head size) at the target's slots for p, so the request's block table addresses both. The last kept row's output
gives draft 1. Drafts 2..k follow one batched pass per position over the requests proposed for: the token just
drafted with the previous pass's output as its hidden, attending to the cached context and to the chain's own keys.
Those chain keys stay in a per-step buffer, never in the paged cache (their positions may lie in blocks not
allocated yet); the next catch-up overwrites the positions the target kept.

Greedy requests draft the argmax. Sampled ones draw from the head's distribution processed with the request's
temperature, top-k and top-p (not its penalties or min-p: any proposal keeps the target's distribution under
rejection sampling, this one only makes acceptance likelier) and return it in `Proposal.probs`.

Options `tree_top_k` (and `tree_depth`, default 4): greedy requests draft a dynamic tree instead (eagle3_tree.py:
the head's top-k children of the best k nodes per depth, the best `num_speculative_tokens` nodes by cumulative draft
probability), verified in one pass with tree attention; sampled requests still draft chains.

Option `native_draft` (default: where it runs): on CPU in float32 with the native kernels built, each request's
catch-up and greedy chain run in one call of the `ember_kernels` kernel `eagle3_draft.c` (the same layer, no torch
op per draft position: at batch 1 those ops cost as much as the target's own step). `true` requires it (refused
where it cannot run), `false` keeps the torch path. `native_draft_weights` (`int8`, the default: a scale per
output row; `bfloat16`; `float32`): how the kernel keeps the head's matrices and the LM head's draft rows. A draft
position streams all of them (more than the L2 cache holds), so narrower ones draft faster; drafts differ from the
float32 head's only at near-ties (outputs never: the target verifies every draft). Sampled requests and trees take
the torch path for their drafts either way (after the kernel's catch-up).

Known limits: KV blocks read from the prefix cache keep the head's K/V of
whichever request computed them (a block's last position then pairs with that request's next token), and blocks
loaded from KV tiers carry none of the head's K/V: drafts there are worse, outputs are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ember_platform.api import DraftKVSpec, Proposal, Request, Speculator, SpeculatorContext, SpeculatorInputs, write_kv
from ember_plugins.speculators.model_dir import read_model_config
from ember_plugins.speculators.native_options import native_draft_choice, native_kernel_blocker, refuse_if_required

CONFIG = "config.json"
WEIGHTS = "eagle3.safetensors"
ROPE_TABLE_LIMIT = 8192  # positions the RoPE table covers at most (8192 x head_dim x 8 bytes: 4 MB at 64)
LONG_QUERY = 16  # requests with more kept rows than this (prompt chunks) attend alone, not padded into the batch


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle, high: the hidden states entering layers 1, n // 2 and n - 1 (the outputs of layers 0, n // 2 - 1
    and n - 2). The last layer's own output is left out: the target's prediction is already in the token fed in."""
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 fuses three layers of the target; it has {num_layers}")
    return (1, num_layers // 2, num_layers - 1)


def _read_config(context: SpeculatorContext) -> dict[str, Any]:
    path, config = read_model_config(context, "eagle3", "EAGLE-3 head", "examples/train_eagle3.py")
    if config.get("architecture") != "eagle3":
        raise ValueError(f"speculator.model: {path} does not describe an EAGLE-3 head (architecture "
                         f"{config.get('architecture')!r}, expected 'eagle3')")
    if not config.get("uses_target_lm_head") or not config.get("uses_target_embeddings"):
        raise ValueError(f"speculator.model: {path}: only heads on the target's own embeddings and LM head are "
                         "supported (uses_target_embeddings and uses_target_lm_head true)")
    target = context.target_config
    for key, target_key in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"),
                            ("num_target_layers", "num_hidden_layers")):
        if int(config.get(key, -1)) != int(target.get(target_key, -2)):
            raise ValueError(f"speculator.model: the EAGLE-3 head in {path} was trained for {key} {config.get(key)}, "
                             f"the model has {target.get(target_key)}")
    layers = config.get("aux_layers")
    n = int(target["num_hidden_layers"])
    if not (isinstance(layers, list) and len(layers) == 3 and all(isinstance(i, int) and 0 <= i < n for i in layers)):
        raise ValueError(f"speculator.model: {path}: aux_layers must be three layer indices in 0..{n - 1}, got "
                         f"{layers!r}")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "draft_vocab_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise ValueError(f"speculator.model: {path}: {key} must be a positive integer, got {config.get(key)!r}")
    return config


@dataclass(slots=True)
class _Kept:
    """One request's kept rows this step, as the head sees them."""

    index: int  # in the batch
    offset: int  # first of its rows in the step's compacted kept rows
    count: int
    last_position: int


def _read_tree(options: Mapping[str, Any], budget: int) -> tuple[int, int] | None:
    """(top_k, depth) from options `tree_top_k` / `tree_depth`, validated; None without `tree_top_k`."""
    top_k, depth = options.get("tree_top_k"), options.get("tree_depth", 4)
    if top_k is None:
        if "tree_depth" in options:
            raise ValueError("speculator.options.tree_depth needs speculator.options.tree_top_k (the tree's width)")
        return None
    for key, value, low, high in (("tree_top_k", top_k, 1, 16), ("tree_depth", depth, 2, 16)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"speculator.options.{key} must be an integer in {low}..{high}, got {value!r}")
    nodes = top_k + (depth - 1) * top_k * top_k
    if budget > nodes:
        raise ValueError(f"speculator.num_speculative_tokens: {budget} is the tree's node budget; a tree of "
                         f"tree_top_k {top_k} and tree_depth {depth} has only {nodes} candidate nodes")
    return top_k, depth


class Eagle3Speculator(Speculator):
    """Reads `[speculator] model` (the head's directory) and options `tree_top_k` / `tree_depth` (module
    docstring)."""

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        super().__init__(options, context)
        self.tree = _read_tree(self.options, context.num_speculative_tokens)
        self.drafts_trees = self.tree is not None
        config = _read_config(context)
        target = context.target_model
        if target is None or not hasattr(target, "lm_head") or not hasattr(getattr(target, "model", None),
                                                                            "embed_tokens"):
            raise ValueError("eagle3 runs its head on the target's embeddings and LM head, which are not in this "
                             "process (a parallel strategy that keeps the model in other processes)")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from ember_plugins.speculators.eagle3_model import Eagle3Draft

        self.layers = tuple(int(i) for i in config["aux_layers"])
        self.draft = Eagle3Draft(int(config["hidden_size"]), config["num_attention_heads"],
                                 config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
                                 float(config.get("rms_norm_eps", 1e-6)), len(self.layers),
                                 config["draft_vocab_size"])
        path = context.model_dir / WEIGHTS  # type: ignore[operator]
        try:
            state = load_file(str(path), device="cpu")
        except (OSError, SafetensorError) as e:
            raise ValueError(f"speculator.model: cannot read the EAGLE-3 head's weights {path}: {e}") from None
        expected = self.draft.state_dict()
        wrong = [f"{name} {tuple(state[name].shape)} (expected {tuple(t.shape)})" for name, t in expected.items()
                 if name in state and state[name].shape != t.shape]
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if wrong or missing or unexpected:
            raise ValueError(f"speculator.model: {path} does not match its {CONFIG} (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}, wrong shapes {wrong[:3]})")
        vocab = state["draft_vocab"]
        if vocab.dtype != torch.long or not bool(((vocab >= 0) & (vocab < context.vocab_size)).all()):
            raise ValueError(f"speculator.model: {path}: draft_vocab must hold token ids in "
                             f"0..{context.vocab_size - 1}")
        self.draft.load_state_dict(state)
        self.draft.to(device=context.device, dtype=context.dtype).eval().requires_grad_(False)
        self.ops = getattr(target, "ops", None)  # the engine's kernel-op table the target was built with
        self.draft.prepare_inference(self.ops)
        self.embed = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.draft_vocab = self.draft.draft_vocab
        weight = getattr(target.lm_head, "weight", None)
        # The LM head's rows of the draft vocabulary, copied once (a quantized LM head keeps its own weights: then the
        # full projection runs and the draft vocabulary's logits are picked from it).
        self.head_weight = weight.detach().index_select(0, self.draft_vocab).to(context.dtype) \
            if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2 else None
        self.rotary = getattr(target.model, "rotary_emb", None)
        self.rope_theta = target_config_rope(context.target_config)
        self.scale = self.draft.head_dim ** -0.5
        self._generator = torch.Generator(device=context.device)
        self._generator.seed()
        # Per request, the position ranges [start, end) whose K/V the head skipped writing (steps with nothing to
        # propose for: see `propose`); attention masks them out until the positions are written again.
        self._gaps: dict[str, list[tuple[int, int]]] = {}
        # Per request skipped since: (the first position not written, its num_preemptions then). The gap stays open
        # (it grows with every skipped step, at no cost per step) until a step writes the request's rows again.
        self._open: dict[str, tuple[int, int]] = {}
        self._rope_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # see `_rope_rows`
        self.native = self._native_kernel(*native_draft_choice(self.options, ("bfloat16", "int8", "float32")))

    def _native_kernel(self, wanted: Any, weight_format: Any) -> Any:
        """The bound native kernel (module docstring, `native_draft`), or None for the torch path."""
        if wanted is False:
            return None
        embed = getattr(self.embed, "weight", None)
        usable = self.head_weight is not None and isinstance(embed, torch.Tensor) and embed.dtype == torch.float32
        why = native_kernel_blocker(
            self.context,
            None if usable else "it needs the target's float32 LM head and embeddings (these are quantized or missing)",
            "ember_kernels.cpu.eagle3_draft", "eagle3_draft_available")
        if why is not None:
            refuse_if_required(wanted, why)
            return None
        from ember_kernels.cpu.eagle3_draft import Eagle3Kernel

        d = self.draft
        weights = [d.fc.weight, d.input_layernorm.weight, d.hidden_norm.weight, d._qkv, d.o_proj.weight,
                   d.post_attention_layernorm.weight, d._gate_up, d.down_proj.weight, d.norm.weight,
                   self.head_weight, embed]
        dims = (self.context.target_config["hidden_size"], d.num_heads, d.num_kv_heads, d.head_dim,
                d.down_proj.weight.shape[1], self.draft_vocab.numel(), embed.shape[0])
        return Eagle3Kernel([w.detach().contiguous() for w in weights], dims, d.norm.eps, self.scale,
                            self.draft_vocab, weight_format)

    def aux_layers(self) -> tuple[int, ...]:
        return self.layers

    def memory_bytes(self) -> int:
        copied = 0 if self.head_weight is None else self.head_weight.numel() * self.head_weight.element_size()
        return copied + sum(p.numel() * p.element_size() for p in self.draft.parameters())

    def kv_cache_spec(self) -> DraftKVSpec:
        return DraftKVSpec(num_layers=1, num_kv_heads=self.draft.num_kv_heads, head_dim=self.draft.head_dim)

    # --- a step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        caches = inputs.draft_kv_caches or self.kv_caches
        if not caches:
            raise ValueError("eagle3 has no draft KV cache: the engine did not allocate the one kv_cache_spec asks for")
        missing = [i for i in self.layers if i not in inputs.aux_hidden_states]
        if missing:
            raise ValueError(f"eagle3 needs the target's hidden states entering layers {missing}, and the step "
                             "carries none")
        if not inputs.propose_for:
            # Nothing to draft for (the batch is past speculation's max_batch_size, or drafts do not pay at this
            # batch size): catching up would cost a pass of the head over the whole batch every step, for drafts
            # nobody asked for. Remember what was skipped instead; later drafts attend around it.
            self._skip(inputs)
            return []
        wanted = set(inputs.propose_for)
        only = None
        if 2 * len(wanted) < sum(n > 0 for n in inputs.num_kept):
            # Drafts for a few of the batch only (the length chooser's probe of a batch where drafts do not pay):
            # catching up the others, prompt chunks included, would cost a head pass over the whole step for drafts
            # nobody asked for (in the mixed-32 bench ~0.3 ms a step, most of eagle3's 3% cost there while not
            # drafting). Their rows become gaps, as in a step without drafts.
            self._skip(inputs, keep=wanted)
            only = wanted
        kept = self._kept(inputs, only=only)
        if not kept:
            return [None] * len(inputs.propose_for)
        for e in kept:  # positions from the first kept one on are written now (or again later): no longer gaps
            self._close(inputs.batch[e.index].request_id, e.last_position - e.count + 1)
        by_index = {e.index: e for e in kept}
        chosen = [by_index.get(i) for i in inputs.propose_for]
        if any(e is None for e in chosen):
            raise ValueError("a request proposed for has no kept rows this step")
        entries = [e for e in chosen if e is not None]
        native = self._native_step(inputs, kept, entries, caches[0])
        if native is None:
            out, tables = self._catch_up(inputs, kept, caches[0])
        else:
            out, tables, drafted = native
            if drafted:  # greedy chains drafted by the kernel; sampled requests' chains follow on the torch path
                rest = [e for e in entries if e.index not in drafted]
                torch_drafts = iter(self._draft(inputs, rest, out, tables, caches[0]) if rest else [])
                return [Proposal(drafted[e.index]) if e.index in drafted else next(torch_drafts) for e in entries]
        if self.tree is None:
            return self._draft(inputs, entries, out, tables, caches[0])
        from ember_plugins.speculators.eagle3_tree import draft_tree

        greedy = [b for b, e in enumerate(entries) if inputs.batch[e.index].params.greedy]
        sampled = [b for b, e in enumerate(entries) if b not in set(greedy)]
        proposals: list[Proposal | None] = [None] * len(entries)
        if greedy:
            trees = draft_tree(self, inputs, [entries[b] for b in greedy], out, tables, caches[0],
                               inputs.num_speculative_tokens, *self.tree)
            for b, proposal in zip(greedy, trees, strict=True):
                proposals[b] = proposal
        if sampled:
            for b, proposal in zip(sampled, self._draft(inputs, [entries[b] for b in sampled], out, tables,
                                                          caches[0]), strict=True):
                proposals[b] = proposal
        return proposals

    def release(self, request_id: str) -> None:
        self._gaps.pop(request_id, None)
        self._open.pop(request_id, None)

    def _skip(self, inputs: SpeculatorInputs, keep: set[int] | None = None) -> None:
        """A step whose rows the head does not write (but for the requests at the batch indices `keep`): open a gap
        for each request not already skipping (a dict lookup for the others: this runs every step drafts do not
        pay, at any batch size)."""
        for i, req in enumerate(inputs.batch):
            if inputs.num_kept[i] <= 0 or req.status.finished or (keep and i in keep):  # finished: released already
                continue
            skipping = self._open.get(req.request_id)
            if skipping is not None and skipping[1] == req.num_preemptions:
                continue  # its open gap grows to this step's rows
            first = int(inputs.positions[inputs.query_start_loc[i]])
            self._trim(req.request_id, first)  # a preempted request's rows from `first` on are computed again
            self._open[req.request_id] = (first, req.num_preemptions)

    def _close(self, request_id: str, first: int) -> None:
        """Rows from `first` on are written this step: the open gap (if any) ends there, later gaps are void."""
        skipping = self._open.pop(request_id, None)
        self._trim(request_id, first)
        if skipping is None or skipping[0] >= first:
            return
        gaps = self._gaps.setdefault(request_id, [])
        if gaps and gaps[-1][1] == skipping[0]:
            gaps[-1] = (gaps[-1][0], first)
        else:
            gaps.append((skipping[0], first))

    def _trim(self, request_id: str, first: int) -> None:
        """Forget skipped positions from `first` on (they are being written, or will be before they are read)."""
        gaps = self._gaps.get(request_id)
        if gaps:
            self._gaps[request_id] = [(a, min(b, first)) for a, b in gaps if a < first]

    def _kept(self, inputs: SpeculatorInputs, only: set[int] | None = None) -> list[_Kept]:
        """The requests whose rows the head writes this step (those at the batch indices `only`, if given), their
        rows numbered in one compacted run."""
        kept, offset = [], 0
        for i, req in enumerate(inputs.batch):
            n = inputs.num_kept[i]
            if n <= 0 or req.status.finished or (only is not None and i not in only):
                continue
            last = int(inputs.positions[inputs.query_start_loc[i] + n - 1])
            if last + 1 >= req.num_tokens:  # the token after the last kept row is not known (nothing was sampled)
                n -= 1
                last -= 1
            if n > 0:
                kept.append(_Kept(i, offset, n, last))
                offset += n
        return kept

    def _rope_rows(self, first: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, hd] for positions first..first + count - 1, contiguous: views of a table of every position
        up to the highest asked for so far (doubling; computing them costs ~6 torch ops a step, a third of what the
        native kernel's Python side does at batch 1), computed directly past ROPE_TABLE_LIMIT."""
        end = first + count
        table = self._rope_tables.get(dtype)
        if table is None or table[0].shape[0] < end:
            if end > ROPE_TABLE_LIMIT:
                cos, sin = self._rope(torch.arange(first, end, device=self.context.device), dtype)
                return cos.contiguous(), sin.contiguous()
            size = min(ROPE_TABLE_LIMIT, max(end, 256, 2 * (0 if table is None else table[0].shape[0])))
            cos, sin = self._rope(torch.arange(size, device=self.context.device), dtype)
            table = self._rope_tables[dtype] = (cos.contiguous(), sin.contiguous())
        return table[0][first:end], table[1][first:end]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, hd] for `positions` [T], computed (the torch path's arbitrary positions)."""
        if self.rotary is not None:
            return self.rotary(positions, dtype)
        from ember_plugins.speculators.eagle3_model import rope_cos_sin

        return rope_cos_sin(positions, self.draft.head_dim, self.rope_theta, dtype)

    def _native_step(self, inputs: SpeculatorInputs, kept: list[_Kept], entries: list[_Kept],
                     cache: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[int]]] | None:
        """The catch-up of every kept request and the greedy chains of the chosen ones (no tree) through the native
        kernel: (the rows' outputs, block tables, drafts by batch index); None where it does not apply this step."""
        if self.native is None or inputs.plan is None:
            return None
        aux = [inputs.aux_hidden_states[i] for i in self.layers]
        k_cache, v_cache = cache[0], cache[1]
        if any(a.dtype != torch.float32 or not a.is_contiguous() for a in aux) or not (
                k_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        k = inputs.num_speculative_tokens
        chains = set() if self.tree is not None else {e.index for e in entries
                                                       if inputs.batch[e.index].params.greedy}
        # Each request's rows and chain positions: one span of positions, so rows of the RoPE table.
        spans = [(e.last_position - e.count + 1, e.count + (k - 1 if e.index in chains else 0)) for e in kept]
        dtype = self.context.dtype
        out = torch.empty(sum(e.count for e in kept), self.draft.fc.weight.shape[0])
        tables = inputs.plan.block_tables
        if tables.dtype != torch.int32 or not tables.is_contiguous():
            tables = tables.to(torch.int32).contiguous()
        token_ids = inputs.token_ids
        drafted: dict[int, list[int]] = {}
        for e, (first, n) in zip(kept, spans, strict=True):
            start = inputs.query_start_loc[e.index]
            req = inputs.batch[e.index]
            next_ids = [*token_ids[start + 1:start + e.count].tolist(), req.token_at(e.last_position + 1)]
            chain = k if e.index in chains else 0
            cos, sin = self._rope_rows(first, n, dtype)
            tokens = self.native.draft(aux, start, e.count, next_ids, cos, sin, first, k_cache, v_cache,
                                       tables[e.index], chain, out[e.offset:e.offset + e.count],
                                       self._gaps.get(req.request_id, ()))
            if tokens is None:
                raise ValueError(f"the native EAGLE-3 kernel refused request {req.request_id}'s step (a position "
                                 "outside its block table?)")
            if chain:
                drafted[e.index] = tokens
        return out, tables, drafted

    def _catch_up(self, inputs: SpeculatorInputs, kept: list[_Kept], cache: tuple[torch.Tensor, ...]) -> tuple[
            torch.Tensor, Any]:
        """Run the head over every request's kept rows, writing their K/V: [N, D] outputs, and the step's block
        tables on the device."""
        device, dtype = self.context.device, self.context.dtype
        rows, next_ids = [], []
        for e in kept:
            start = inputs.query_start_loc[e.index]
            rows.append(torch.arange(start, start + e.count))
            req = inputs.batch[e.index]
            # Row p reads the token at p + 1: the next row's input, and for the last row the token sampled after it.
            next_ids.append(inputs.token_ids[start + 1:start + e.count])
            next_ids.append(torch.tensor([req.token_at(e.last_position + 1)], dtype=torch.long))
        row_index = torch.cat(rows)
        if inputs.plan is None:
            raise ValueError("eagle3 needs the step's block tables, and these inputs carry no step plan")
        # The kept rows' slots in the request's blocks (the target's slots for the same positions), on the host.
        host_tables = inputs.plan.block_tables
        block_size = cache[0].shape[2]
        host_positions = inputs.positions[row_index]
        owner = torch.repeat_interleave(torch.tensor([e.index for e in kept]), torch.tensor([e.count for e in kept]))
        slots = (host_tables[owner, host_positions // block_size].long() * block_size
                 + host_positions % block_size).to(device)
        tables = host_tables.to(device)
        row_dev = row_index.to(device)
        positions = host_positions.to(device)
        aux = torch.cat([inputs.aux_hidden_states[i].index_select(0, row_dev) for i in self.layers], dim=-1)
        hidden = self.draft.fuse(aux.to(dtype))
        embeds = self.embed(torch.cat(next_ids).to(device))
        cos, sin = self._rope(positions, dtype)
        q, k, v = self.draft.qkv(embeds, hidden, cos, sin)
        if self.ops is None or not self.ops.write_kv(cache, k, v, slots):
            write_kv(cache, k, v, slots)
        attn = torch.empty_like(q)
        short = [e for e in kept if e.count <= LONG_QUERY]
        groups = [[e] for e in kept if e.count > LONG_QUERY] + ([short] if short else [])
        for group in groups:
            self._attend_context(group, inputs.batch, q, positions, tables, cache, attn)
        return self.draft.finish(attn.reshape(len(row_index), -1), hidden), tables

    def _context(self, entries: Sequence[_Kept], requests: Sequence[Request], block_tables: torch.Tensor,
                 cache: tuple[torch.Tensor, ...], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, int,
                                                                         torch.Tensor | None]:
        """The cached K/V of positions 0..last of each entry, [n, Hkv, L + extra, hd] (`extra` free slots after), and
        [n, L + extra] which of those keys were written (None: all of them)."""
        k_cache, v_cache = cache[0], cache[1]
        block_size = k_cache.shape[2]
        num_blocks = -(-(max(e.last_position for e in entries) + 1) // block_size)
        index = torch.tensor([e.index for e in entries], device=block_tables.device)
        tables = block_tables.index_select(0, index)[:, :num_blocks].long()  # [n, nb]
        length = num_blocks * block_size

        def gather(c: torch.Tensor) -> torch.Tensor:
            g = c[tables].permute(0, 2, 1, 3, 4).reshape(len(entries), c.shape[1], length, c.shape[3])
            return F.pad(g, (0, 0, 0, extra)) if extra else g

        written = None
        if any(self._gaps.get(requests[e.index].request_id) for e in entries):
            written = torch.ones(len(entries), length + extra, dtype=torch.bool)
            for row, e in enumerate(entries):
                for a, b in self._gaps.get(requests[e.index].request_id, ()):
                    written[row, a:b] = False
            written = written.to(k_cache.device)
        return gather(k_cache), gather(v_cache), length, written

    def _attend_context(self, group: list[_Kept], batch: Sequence[Request], q: torch.Tensor, positions: torch.Tensor,
                        block_tables: torch.Tensor, cache: tuple[torch.Tensor, ...], attn: torch.Tensor) -> None:
        """Causal attention of the group's kept rows over their cached context (just written), into `attn`."""
        keys, values, length, written = self._context(group, batch, block_tables, cache)
        width = max(e.count for e in group)
        counts = torch.tensor([e.count for e in group], device=q.device)
        j = torch.arange(width, device=q.device)
        offsets = torch.tensor([e.offset for e in group], device=q.device)
        index = offsets[:, None] + torch.minimum(j[None, :], counts[:, None] - 1)  # [n, W]: padding repeats a row
        query_pos = positions[index]  # [n, W]
        mask = torch.arange(length, device=q.device)[None, None, :] <= query_pos[:, :, None]  # [n, W, L]
        if written is not None:
            mask &= written[:, None, :]
        out = F.scaled_dot_product_attention(q[index].transpose(1, 2), keys, values, attn_mask=mask[:, None],
                                             scale=self.scale, enable_gqa=True)  # [n, H, W, hd]
        valid = j[None, :] < counts[:, None]
        attn[index[valid]] = out.transpose(1, 2)[valid]

    def _draft(self, inputs: SpeculatorInputs, chosen: list[_Kept], out: torch.Tensor, tables: torch.Tensor,
               cache: tuple[torch.Tensor, ...]) -> list[Proposal | None]:
        """k drafts per chosen request: draft 1 from its last kept row, then one batched pass per position."""
        # With a tree, num_speculative_tokens is the trees' node budget: sampled requests' chains stop at its depth.
        k = inputs.num_speculative_tokens if self.tree is None else min(inputs.num_speculative_tokens, self.tree[1])
        device, dtype = self.context.device, self.context.dtype
        requests = [inputs.batch[e.index] for e in chosen]
        sampler = _DraftSampler(requests, self._generator, self.draft_vocab, self.context.vocab_size)
        last = torch.tensor([e.offset + e.count - 1 for e in chosen], device=device)
        hidden = out.index_select(0, last)  # [m, D]
        tokens = sampler.choose(self._logits(hidden))
        drafted = [tokens]
        if k > 1:
            keys, values, length, written = self._context(chosen, inputs.batch, tables, cache, extra=k - 1)
            last_pos = torch.tensor([e.last_position for e in chosen], device=device)
            visible = torch.arange(length + k - 1, device=device)[None, :] <= last_pos[:, None]  # [m, L + k - 1]
            if written is not None:
                visible &= written
            m, heads, hd = len(chosen), self.draft.num_heads, self.draft.head_dim
            chain_pos = last_pos[:, None] + torch.arange(1, k, device=device)[None, :]  # [m, k - 1]
            cos_all, sin_all = (t.view(m, k - 1, -1) for t in self._rope(chain_pos.reshape(-1), dtype))
            for j in range(1, k):
                cos, sin = cos_all[:, j - 1], sin_all[:, j - 1]
                q, kj, vj = self.draft.qkv(self.embed(tokens), hidden, cos, sin)
                keys[:, :, length + j - 1] = kj
                values[:, :, length + j - 1] = vj
                visible[:, length + j - 1] = True
                end = length + j
                o = F.scaled_dot_product_attention(q[:, :, None], keys[:, :, :end], values[:, :, :end],
                                                   attn_mask=visible[:, None, None, :end], scale=self.scale,
                                                   enable_gqa=True)  # [m, H, 1, hd]
                hidden = self.draft.finish(o.reshape(m, heads * hd), hidden)
                tokens = sampler.choose(self._logits(hidden))
                drafted.append(tokens)
        ids = torch.stack(drafted, dim=1).tolist()  # [m, k]: the one host sync
        return [Proposal(row, sampler.probs(b)) for b, row in enumerate(ids)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[m, D] -> [m, N] float32 logits over the draft vocabulary."""
        x = self.draft.logits_input(hidden)
        if self.head_weight is not None:
            return (F.linear(x, self.head_weight) if self.ops is None else self.ops.linear(x, self.head_weight)).float()
        return self.lm_head(x).float().index_select(1, self.draft_vocab)


def target_config_rope(config: Mapping[str, Any]) -> float:
    """rope_theta from a Hugging Face config (newer ones keep it in rope_parameters)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or config.get("rope_theta") or 10_000.0)


class _DraftSampler:
    """Per draft position: the argmax for greedy requests; for sampled ones a token drawn from the head's logits
    processed with the request's temperature, top-k and top-p, whose distributions (over the target's vocabulary, 0
    outside the draft vocabulary) it keeps for `Proposal.probs`. Logits come over the draft vocabulary; tokens go out as
    target ids."""

    def __init__(self, requests: Sequence[Request], shared: torch.Generator, draft_vocab: torch.Tensor,
                 vocab_size: int) -> None:
        device = draft_vocab.device
        self.draft_vocab, self.vocab_size = draft_vocab, vocab_size
        self.sampled = [b for b, r in enumerate(requests) if not r.params.greedy]
        self._probs: dict[int, list[torch.Tensor]] = {b: [] for b in self.sampled}
        if not self.sampled:
            return
        params = [requests[b].params for b in self.sampled]
        self.index = torch.tensor(self.sampled, device=device)
        self.temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
        self.top_k = [p.top_k for p in params]
        self.top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        # A seeded request draws its drafts from a generator of its own, seeded by its seed and length, so a seeded
        # request's output does not depend on what else shared the batch.
        self.generators: list[torch.Generator] = []
        for b in self.sampled:
            req = requests[b]
            if req.params.seed is None:
                self.generators.append(shared)
            else:
                g = torch.Generator(device=device)
                g.manual_seed((int(req.params.seed) * 1_000_003 + req.num_tokens) % 2**63)
                self.generators.append(g)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[m, N] -> [m] target token ids."""
        tokens = logits.argmax(-1)
        if self.sampled:
            probs = self._processed(logits.index_select(0, self.index))
            for row, (b, g) in enumerate(zip(self.sampled, self.generators, strict=True)):
                tokens[b] = torch.multinomial(probs[row], 1, generator=g)[0]
                self._probs[b].append(probs[row])
        return self.draft_vocab[tokens]

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits / self.temperature
        vocab = x.shape[-1]
        sorted_x, order = x.sort(dim=-1)  # ascending, as the engine's sampler: top-p works on what top-k left
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in self.top_k], device=x.device)
        kth = sorted_x.gather(1, (vocab - ks)[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - self.top_p)
        drop[:, -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x).softmax(dim=-1)

    def probs(self, b: int) -> torch.Tensor | None:
        rows = self._probs.get(b)
        if not rows:
            return None
        drafted = torch.stack(rows)  # [k, N]
        full = drafted.new_zeros(len(rows), self.vocab_size)
        return full.index_copy_(1, self.draft_vocab, drafted)
