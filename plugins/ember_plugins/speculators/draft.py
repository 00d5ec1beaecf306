"""`draft` speculation: a small draft model of the same tokenizer drafts k tokens ahead of the target (Leviathan et
al. 2023; Chen et al. 2023).

The draft is a Hugging Face checkpoint in the package's `[speculator] model` directory (config.json +
model.safetensors; made for the example by `examples/train_draft.py`), built and loaded with the engine's own model
code (`build_model` / `load_weights`) on the selected attention backend, with its own paged KV cache (`kv_cache_spec`:
as many blocks as the target's, so a request's block table addresses both, plus scratch blocks, below). Each step,
after the target verified the step's drafts, the draft runs for every request it drafts for at once:

1. one pass over each request's tokens its draft cache does not hold yet (the whole sequence the first time it
   drafts for it, prompt included, or after a preemption; else the tokens verified since it last drafted), the newest
   last: its logits give draft 1;
2. k - 1 passes of one token per drafting request (the previous draft at the next position): drafts 2..k.

Both run on `ChainDecoder` (draft_chain.py: the context's K/V gathered once per step into a dense buffer, a pass in a
few tensor ops, drafted positions' K/V kept out of the paged cache) where the draft is a plain full-precision Llama,
every drafting request is greedy and pass 1 has at most MAX_QUERY new tokens per request; a pass over a whole prompt,
and every pass of a step with a sampled request (whose seeded drafts must not depend on the batch), runs on the
engine's model code.
At batch 1 on the example a one-token pass of the model code cost about half a target pass, mostly fixed per-op cost.

Option `native_draft` (default: where it runs): on CPU in float32 with the native kernels built, each greedy
request's step (pass 1, whatever its length, and passes 2..k) is one call of the `ember_kernels` kernel
`draft_llama.c`: no torch op per pass (the chain decoder's ~60 ops per pass still cost about a third of a target
step at batch 1, which held the draft to ~1.2x of no speculation). `true` requires it (refused where it cannot
run), `false` keeps the torch paths. `native_draft_weights` (`int8`, the default: a scale per output row;
`bfloat16`; `float32`): how the kernel keeps the draft's matrices; every draft position streams all of them, so
narrower ones draft faster, and drafts differ from the float32 model's only at near-ties (outputs never: the
target verifies every draft). Sampled requests keep the torch paths either way (their drafts are drawn between
passes).

The cache catches up lazily, when a request is drafted for, so a step that drafts nothing (the engine chose k = 0:
a large batch, low acceptance) costs no pass at all. The drafted positions' KV is written where the request's block
table puts those positions and is simply written over when the true tokens arrive (pass 1 rewrites every position
from the newest the cache was sure of); positions past the blocks a request holds yet go to scratch blocks past the
shared ones (`DraftKVSpec.scratch_blocks`), a few per request for the step. A request that needs more scratch than
is left gets no drafts that step. Each request's draft KV is computed from its own tokens (never taken from a prefix
cache hit, whose blocks it rewrites with the same values), so KV tiers and sleep cost it nothing but a recompute.

Greedy requests draft the argmax. Sampled requests draw each draft from the draft's distribution after the request's
own temperature, top-k, top-p and min-p (penalties and logit bias are the target's alone: rejection sampling keeps the
target's distribution whatever the draft's is, as long as each draft was drawn from the distribution returned in
`Proposal.probs`). Randomness: a seeded request draws its drafts from a generator of its own, seeded from its seed
(so its drafts never depend on the rest of the batch, and a run with a fixed draft length, `adaptive = false`,
reproduces its output); unseeded requests share one generator. With the adaptive draft length the number of drafts
per step depends on measured timings, so a seeded request's output follows the same distribution but may differ
between runs.

Checked at load: the directory and its config.json and weights (errors name `speculator.model`), and that the draft
speaks the target's tokens: the same vocab_size and special token ids, and where the draft directory has a
tokenizer.json, the same vocabulary and merges as the target's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ember_platform.api import (
    AttentionLayerSpec,
    AttentionMetadata,
    DraftKVSpec,
    KVCache,
    Proposal,
    Request,
    Speculator,
    SpeculatorContext,
    SpeculatorInputs,
    build_model,
    kv_cache_block_shape,
    load_weights,
)
from ember_plugins.speculators.draft_chain import MAX_QUERY, ChainDecoder
from ember_plugins.speculators.model_dir import read_model_config
from ember_plugins.speculators.native_options import native_draft_choice, native_kernel_blocker, refuse_if_required

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SCRATCH_REQUESTS = 64  # requests per step whose drafted positions may need scratch blocks
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
_DRAFT_SEED_SALT = 0x5EED_D2AF  # a request's draft generator is seeded apart from its own sampling generator


def _tokenizer_identity(path: Path) -> Any:
    """What makes two tokenizer.json files tokenize alike: the model (vocab, merges), added tokens, pre-tokenizer."""
    data = json.loads(path.read_text())
    return (data.get("model"), [(t.get("id"), t.get("content")) for t in data.get("added_tokens") or []],
            data.get("pre_tokenizer"), data.get("normalizer"))


def read_draft_config(context: SpeculatorContext) -> dict[str, Any]:
    """The draft's config.json, checked against the target (ValueError naming speculator.model and the key)."""
    path, config = read_model_config(context, "draft", "draft model",
                                     "examples/train_draft.py, a Hugging Face checkpoint")
    root = path.parent
    target = context.target_config
    for key in ("vocab_size", *SPECIAL_IDS):
        if (key == "vocab_size" or key in config or key in target) and config.get(key) != target.get(key):
            raise ValueError(f"speculator.model: {path}: {key} is {config.get(key)}, the target's is "
                             f"{target.get(key)} (a draft model must use the target's tokenizer)")
    draft_tokenizer = root / TOKENIZER
    target_tokenizer = context.target_dir / TOKENIZER if context.target_dir is not None else None
    if draft_tokenizer.is_file() and target_tokenizer is not None and target_tokenizer.is_file():
        try:
            same = _tokenizer_identity(draft_tokenizer) == _tokenizer_identity(target_tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculator.model: cannot read {draft_tokenizer}: {e}") from None
        if not same:
            raise ValueError(f"speculator.model: {draft_tokenizer} is not the target's tokenizer "
                             f"({target_tokenizer}): a draft model must tokenize exactly as the target does")
    return config


def _process(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """[n, V] float32 logits -> the distributions sampled requests draw drafts from: temperature, top-k, top-p,
    min-p of each request (rows of greedy requests are left as they are; their drafts are the argmax)."""
    params = [r.params for r in requests]
    x = logits / torch.tensor([max(p.temperature, 1e-5) if not p.greedy else 1.0 for p in params],
                              device=logits.device)[:, None]
    vocab = x.shape[-1]
    top_k = [p.top_k if p.top_k and 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_x, order = x.sort(dim=-1)  # ascending, as the engine's sampler does
        kth = sorted_x.gather(1, (vocab - torch.tensor(top_k, device=x.device))[:, None])
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - torch.tensor(top_p, device=x.device))[:, None]
        drop[:, -1] = False
        x = torch.empty_like(x).scatter_(1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(dim=-1)
    min_p = [getattr(p, "min_p", 0.0) or 0.0 for p in params]
    if any(min_p):
        threshold = torch.tensor(min_p, device=x.device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class DraftSpeculator(Speculator):
    """Runs a draft model (`[speculator] model`); options `native_draft`, `native_draft_weights` (module docstring)."""

    sees_steps_without_drafts = False  # its draft cache catches up lazily, when drafting resumes

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        super().__init__(options, context)
        config = read_draft_config(context)
        if context.attention_backend is None:
            raise ValueError("draft runs its model on the engine's attention backend, which this engine does not "
                             "give speculators (SpeculatorContext.attention_backend)")
        root = context.model_dir
        assert root is not None
        try:
            self.model = build_model(config, context.attention_backend, context.dtype, context.device,
                                     ops=context.kernel_ops)
            load_weights(self.model, root)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"speculator.model: cannot load the draft model in {root}: {e}") from None
        self.model.eval().requires_grad_(False)
        args = self.model.args
        self.num_layers, self.num_kv_heads, self.head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        if any(w is not None for w in args.sliding_windows):
            raise ValueError(f"speculator.model: {root / CONFIG}: a draft model with sliding-window attention is not "
                             "supported yet")
        block_size = context.block_size
        layer = AttentionLayerSpec(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5, None,
                                   context.dtype)
        spec = self.model.attention_backends[0].kv_cache_spec(block_size)
        expected = kv_cache_block_shape(block_size, layer.num_kv_heads, layer.head_dim)
        if spec.layout != "HND" or [t[0] for t in spec.tensors[:2]] != [expected, expected] or len(spec.tensors) != 2:
            raise ValueError(f"draft keeps its KV cache in the default HND layout; attention backend "
                             f"{getattr(self.model.attention_backends[0], 'name', '?')} lays it out as {spec.layout}")
        self.block_size = block_size
        # Positions n - 1 .. n + k - 2 of a request that holds blocks for fewer: at most this many blocks past them.
        self.scratch_per_request = -(-context.num_speculative_tokens // block_size) + 1
        self.num_scratch = SCRATCH_REQUESTS * self.scratch_per_request
        backends = {id(b): b for b in self.model.attention_backends}.values()
        # The drafting passes in few ops (draft_chain.py) where the draft is a plain full-precision Llama; else (and
        # for first passes over many tokens) the engine's model code.
        self.chain = ChainDecoder(self.model) if ChainDecoder.supports(self.model) else None
        self.native = self._native_kernel(*native_draft_choice(self.options, ("int8", "bfloat16", "float32")))
        self._cos = self._sin = torch.empty(0)  # RoPE rows of positions 0.. for the kernel, grown on demand
        self._kernel_reads_caches = False  # set by bind_kv_cache
        self.builders = [builder for b in backends if hasattr(b, "metadata_builder")
                         and (builder := b.metadata_builder(block_size, context.device)) is not None]
        self._shared_generator = torch.Generator(device=context.device)
        self._shared_generator.seed()
        self._generators: dict[str, torch.Generator] = {}
        # request id -> (its block list when last drafted for, positions 0..n - 1 its draft cache holds since)
        self._done: dict[str, tuple[list[int], int]] = {}

    def _native_kernel(self, wanted: Any, weight_format: Any) -> Any:
        """The bound native kernel (module docstring, `native_draft`), or None for the torch paths."""
        if wanted is False:
            return None
        model = self.model
        plain = self.chain is not None and all(
            b is None for layer in self.chain.layers
            for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias))
        why = native_kernel_blocker(
            self.context, None if plain else "it runs a plain Llama draft with full-precision linears and no biases",
            "ember_kernels.cpu.draft_llama", "draft_llama_available")
        if why is not None:
            refuse_if_required(wanted, why)
            return None
        from ember_kernels.cpu.draft_llama import DraftLlamaKernel

        args, inner = model.args, model.model
        weights = {"embed": inner.embed_tokens.weight, "norm": inner.norm.weight, "lm_head": model.lm_head.weight}
        layers = [{"input_layernorm": layer.input_layernorm.weight, "qkv": layer.self_attn.qkv_proj.weight,
                   "o_proj": layer.self_attn.o_proj.weight,
                   "post_attention_layernorm": layer.post_attention_layernorm.weight,
                   "gate_up": layer.mlp.gate_up_proj.weight, "down_proj": layer.mlp.down_proj.weight}
                  for layer in inner.layers]
        dims = (args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                layers[0]["down_proj"].shape[1], weights["embed"].shape[0])
        return DraftLlamaKernel({n: w.detach() for n, w in weights.items()},
                                [{n: w.detach() for n, w in layer.items()} for layer in layers], dims,
                                inner.norm.eps, args.head_dim ** -0.5, weight_format)

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_cache_spec(self) -> DraftKVSpec:
        return DraftKVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.context.dtype,
                           scratch_blocks=self.num_scratch)

    def bind_kv_cache(self, kv_caches: list[KVCache]) -> None:
        super().bind_kv_cache(kv_caches)
        self._done.clear()  # a new (or woken, zeroed) cache holds nothing yet
        # The kernel reads float32 contiguous CPU caches; others (an fp8 KV cache, say) keep the torch paths.
        self._kernel_reads_caches = all(c.dtype == torch.float32 and c.is_contiguous() and c.is_cpu
                                        for pair in kv_caches for c in pair[:2])
        if self.chain is not None:
            self.chain.reset()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._done.pop(request_id, None)
        if self.chain is not None:
            self.chain.forget(request_id)

    # --- one step ---------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, query_lens: list[int],
                 seq_lens: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Run the draft over a batch (each request's tokens the last query_lens[i] of its seq_lens[i], in the
        blocks of its row of `tables`, all on the device); float32 logits of `rows`."""
        device = self.context.device
        lens = torch.tensor(query_lens, dtype=torch.long)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=starts[1:])
        owner = torch.repeat_interleave(torch.arange(len(query_lens)), lens, output_size=int(starts[-1]))
        bs = self.block_size
        slots = tables[owner, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slots.to(device), query_start_loc=starts.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device), block_tables=tables.to(device),
            query_lens=query_lens, seq_lens_list=seq_lens, max_query_len=max(query_lens),
            max_seq_len=max(seq_lens), decode_only=all(q == 1 for q in query_lens))
        for builder in self.builders:
            builder.build(meta)
        hidden = self.model(ids.to(device), positions.to(device), meta, self.kv_caches)
        return self.model.compute_logits(hidden[rows.to(device)])

    def _first_pass(self, reqs: list[Request], starts: list[int], tables: torch.Tensor) -> torch.Tensor:
        """Pass 1 through the engine's model code (each request's tokens from starts[i]): float32 logits [n, V] of
        each request's newest token."""
        ids = [torch.tensor(r.all_token_ids[d:], dtype=torch.long) for r, d in zip(reqs, starts, strict=True)]
        positions = [torch.arange(d, r.num_tokens, dtype=torch.long) for r, d in zip(reqs, starts, strict=True)]
        query_lens = [r.num_tokens - d for r, d in zip(reqs, starts, strict=True)]
        rows = torch.tensor(query_lens).cumsum(0) - 1
        return self._forward(torch.cat(ids), torch.cat(positions), tables, query_lens,
                             [r.num_tokens for r in reqs], rows)

    def _chain_first(self, reqs: list[Request], starts: list[int], tables: torch.Tensor, k: int) -> torch.Tensor:
        """Pass 1 on the chain decoder (every request has at most MAX_QUERY new tokens): float32 logits [n, V] of
        each request's newest token. Shorter runs are padded at the end (positions past the request's tokens,
        which its later passes write before they read them; never written to the paged cache)."""
        assert self.chain is not None
        bs, device = self.block_size, self.context.device
        query_lens = [r.num_tokens - d for r, d in zip(reqs, starts, strict=True)]
        width = max(query_lens)
        ids, positions, rows, batch_rows, slots = [], [], [], [], []
        table_rows = tables.tolist()
        for b, (req, done) in enumerate(zip(reqs, starts, strict=True)):
            q_len = query_lens[b]
            ids.extend(req.all_token_ids[done:] + [0] * (width - q_len))
            positions.extend(range(done, done + width))
            for j in range(q_len):
                pos = done + j
                rows.append(b * width + j)
                batch_rows.append(b)
                slots.append(table_rows[b][pos // bs] * bs + pos % bs)
        self.chain.start(self.kv_caches, tables, starts,
                         max(max(r.num_tokens + k - 1, d + width) for r, d in zip(reqs, starts, strict=True)),
                         keep=(reqs[0].request_id, reqs[0].block_ids) if len(reqs) == 1 else None)
        write = (torch.tensor(rows, device=device), torch.tensor(batch_rows, device=device),
                 torch.tensor(slots, dtype=torch.long, device=device))
        logits = self.chain.forward(torch.tensor(ids, device=device).view(len(reqs), width),
                                    torch.tensor(positions, device=device).view(len(reqs), width), write,
                                    first=starts[0] if len(reqs) == 1 else None)
        newest = torch.tensor([q - 1 for q in query_lens], device=device)
        return logits[torch.arange(len(reqs), device=device), newest]

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.params.seed
        if seed is None:
            return self._shared_generator
        generator = self._generators.get(req.request_id)
        if generator is None:
            generator = torch.Generator(device=self.context.device)
            generator.manual_seed((seed ^ _DRAFT_SEED_SALT) & _SEED_MASK)
            self._generators[req.request_id] = generator
        return generator

    def _draw(self, logits: torch.Tensor, requests: list[Request], sampled: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next draft of each request ([n] int64), and the distributions of the sampled ones ([len(sampled), V])."""
        tokens = logits.argmax(dim=-1)
        if not sampled:
            return tokens, None
        picked = [requests[i] for i in sampled]
        probs = _process(logits[sampled], picked)
        noise = torch.empty_like(probs)
        for row, req in enumerate(picked):
            noise[row].exponential_(generator=self._generator(req))
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        tokens[sampled] = (probs / noise).argmax(dim=-1)  # an exponential race: token t wins with probability p[t]
        return tokens, probs

    @torch.inference_mode()
    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        if not self.kv_caches:
            raise ValueError("draft has no KV cache bound (the engine allocates the one kv_cache_spec declares)")
        bs, k = self.block_size, inputs.num_speculative_tokens
        scratch_next = self.kv_caches[0][0].shape[0] - self.num_scratch
        scratch_end = self.kv_caches[0][0].shape[0]
        drafting: dict[int, list[int]] = {}  # batch index -> its block table for the draft passes
        for i in inputs.propose_for:
            req = inputs.batch[i]
            if req.num_computed_tokens != req.num_tokens - 1:  # the target computed all but the newest token
                continue
            needed = (req.num_tokens - 1 + k - 1) // bs + 1
            extra = max(0, needed - len(req.block_ids))
            if scratch_next + extra > scratch_end:
                continue  # out of scratch blocks this step: no drafts for this one
            drafting[i] = list(req.block_ids) + list(range(scratch_next, scratch_next + extra))
            scratch_next += extra
        if not drafting:  # nothing to draft: no pass at all (the cache catches up when drafting resumes)
            return [None] * len(inputs.propose_for)
        # Pass 1: each drafting request's tokens the draft cache does not hold yet (all of them the first time, or
        # after a preemption; else those since its last drafting step), the newest last: its logits give draft 1.
        order = list(drafting)
        reqs = [inputs.batch[i] for i in order]
        starts = []
        for req in reqs:
            blocks, done = self._done.get(req.request_id, (None, 0))
            if blocks is not req.block_ids or done > req.num_tokens - 1:
                done = 0  # new, or preempted (its blocks freed: a new list) and recomputed: start over
            starts.append(done)
            # Held from now on: every position before the newest (the newest's KV may sit in a scratch block, and the
            # drafted positions' KV is only a guess: both are written again next time).
            self._done[req.request_id] = (req.block_ids, req.num_tokens - 1)
        by_index: dict[int, Proposal] = {}
        rest = list(range(len(reqs)))
        if self.native is not None and self._kernel_reads_caches:
            # Greedy requests: one kernel call each (a sampled request's drafts are drawn from its generator between
            # passes, so it keeps the torch paths).
            rest = [j for j in rest if not reqs[j].params.greedy]
            for j, (i, req) in enumerate(zip(order, reqs, strict=True)):
                if req.params.greedy:
                    by_index[i] = Proposal(self._native_draft(req, starts[j], drafting[i], k), None)
        if rest:
            width = max(len(drafting[order[j]]) for j in rest)
            draft_tables = torch.stack([torch.nn.functional.pad(torch.tensor(drafting[order[j]], dtype=torch.int32),
                                                                (0, width - len(drafting[order[j]]))) for j in rest])
            tokens, dists = self._torch_draft([reqs[j] for j in rest], [starts[j] for j in rest], draft_tables, k)
            for j, row, dist in zip(rest, tokens, dists, strict=True):
                by_index[order[j]] = Proposal(row, dist)
        return [by_index.get(i) for i in inputs.propose_for]

    def _native_draft(self, req: Request, start: int, blocks: list[int], k: int) -> list[int]:
        """A greedy request's step on the native kernel: the tokens from `start` on into the cache, k drafts."""
        end = req.num_tokens - 1 + k  # RoPE rows: positions start .. num_tokens + k - 2
        if self._cos.shape[0] < end:
            positions = torch.arange(max(end, 2 * self._cos.shape[0], 256))
            cos, sin = self.model.model.rotary_emb(positions, torch.float32)
            self._cos, self._sin = cos.contiguous(), sin.contiguous()
        tokens = self.native.draft(req.all_token_ids[start:], start, self._cos[start:end], self._sin[start:end],
                                   [pair[0] for pair in self.kv_caches], [pair[1] for pair in self.kv_caches],
                                   torch.tensor(blocks, dtype=torch.int32), k)
        if tokens is None:
            raise ValueError(f"the native draft kernel refused request {req.request_id}'s step (a token or position "
                             "outside the draft's vocabulary or block table?)")
        return tokens

    def _torch_draft(self, reqs: list[Request], starts: list[int], draft_tables: torch.Tensor, k: int
                     ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts of these requests through torch ops (the chain decoder, or the model code: see the module
        docstring): each one's k tokens, and for sampled ones the [k, V] distributions they were drawn from."""
        device = self.context.device
        sampled = [j for j, r in enumerate(reqs) if not r.params.greedy]
        # Sampled requests draft on the model code, whose kernels sum each row in one order whatever the batch, so a
        # seeded request's drafts (and output) are the same alone and in any batch; the chain decoder's torch.mm and
        # attention are not batch-invariant, which greedy drafts (verified exactly) do not need.
        chain = self.chain if not sampled else None
        if chain is not None and max(r.num_tokens - d for r, d in zip(reqs, starts, strict=True)) <= MAX_QUERY:
            logits = self._chain_first(reqs, starts, draft_tables.to(device), k)
        else:
            logits = self._first_pass(reqs, starts, draft_tables)
            if chain is not None and k > 1:
                chain.start(self.kv_caches, draft_tables.to(device), [r.num_tokens for r in reqs],
                            max(r.num_tokens for r in reqs) + k - 1,
                            keep=(reqs[0].request_id, reqs[0].block_ids) if len(reqs) == 1 else None)
        columns, probs = [], []
        current, p = self._draw(logits, reqs, sampled)
        columns.append(current)
        probs.append(p)
        # Passes 2..k: one token per drafting request, the previous draft at the next position.
        last = torch.tensor([r.num_tokens - 1 for r in reqs], dtype=torch.long)
        every = torch.arange(len(reqs), dtype=torch.long)
        last_d = last.to(device)
        for j in range(1, k):
            pos = last + j
            if chain is not None:
                logits = chain.forward(current.view(-1, 1).to(device), (last_d + j).view(-1, 1),
                                       first=reqs[0].num_tokens - 1 + j if len(reqs) == 1 else None)[:, 0]
            else:
                logits = self._forward(current.cpu(), pos, draft_tables, [1] * len(reqs), (pos + 1).tolist(), every)
            current, p = self._draw(logits, reqs, sampled)
            columns.append(current)
            probs.append(p)
        tokens = torch.stack(columns, dim=1).tolist()  # [n, k]: the one host sync of the drafts
        sampled_row = {j: row for row, j in enumerate(sampled)}
        dists: list[torch.Tensor | None] = []
        for j in range(len(reqs)):
            row = sampled_row.get(j)
            dists.append(None if row is None else torch.stack([step[row] for step in probs]))  # type: ignore[index]
        return tokens, dists
