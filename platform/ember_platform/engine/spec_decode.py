"""The engine core's side of speculative decoding: what each step's plan must return for the speculator
(hidden states, aux layers), the per-step `SpeculatorInputs`, the drafts it proposes (cut to what the
request has room for), and their draft probabilities, kept until the target verifies them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ember_platform.engine.request import Request, RequestStatus
from ember_platform.engine.spec_length import SpeculationLength
from ember_platform.engine.spec_tree import accepted_path, depths, is_chain, prune
from ember_platform.engine.speculation import Speculator, SpeculatorInputs
from ember_platform.engine.step_plan import StepOutput, StepPlan


class SpecDecoder:
    """Drives one speculator for an engine."""

    def __init__(self, speculator: Speculator, *, num_speculative_tokens: int, max_batch_size: int | None,
                 max_model_len: int, num_layers: int, adaptive: bool = True) -> None:
        self.speculator = speculator
        self.k = num_speculative_tokens
        self.length = SpeculationLength(num_speculative_tokens, adaptive=adaptive,
                                        tree=bool(speculator.drafts_trees))
        self.max_batch_size = max_batch_size
        # What a step and a proposal cost, for choosing the draft length: on a CPU the process's CPU time, which a
        # shared machine's other processes barely move (its wall time swings by more than drafts change a step:
        # measured +-15% run to run at load 6-12 on 2 cores, so the choice flipped); elsewhere wall time (a GPU's
        # work is not this process's CPU time).
        self.clock = time.process_time if speculator.context.device.type == "cpu" else time.perf_counter
        self.max_model_len = max_model_len
        aux = tuple(int(i) for i in speculator.aux_layers())
        outside = [i for i in aux if not 0 <= i < num_layers]
        if outside:
            raise ValueError(f"speculator {type(speculator).__name__} asks for the hidden states of layer(s) "
                             f"{outside}, but the model has layers 0..{num_layers - 1}")
        self.aux_layers = tuple(sorted(set(aux)))
        self.return_hidden_states = bool(speculator.uses_hidden_states)
        self.draft_kv_caches: list = []
        self._probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] probabilities of its pending drafts
        self._paths: dict[str, list[int]] = {}  # this step's tree requests: request id -> accepted nodes
        self.num_tree_moves = 0  # accepted tree paths off the first nodes, whose KV the engine moved

    def tree_paths(self, requests: Sequence[Request], tokens: Sequence[list[int] | None]) -> dict[str, list[int]]:
        """The accepted nodes of this step's tree requests (by request id), kept for `record_step` and `propose`."""
        self._paths = {req.request_id: accepted_path(tree, req.spec_token_ids, new)
                       for req, new in zip(requests, tokens, strict=True)
                       if new is not None and req.spec_parents is not None and (tree := req.spec_tree) is not None}
        self.num_tree_moves += sum(any(node != d for d, node in enumerate(path)) for path in self._paths.values())
        return self._paths

    def record_step(self, num_tokens: int, seconds: float, verified: Sequence[tuple[int, int, bool]],
                    request_ids: Sequence[str] = (), *, num_requests: int, num_drafts: int,
                    num_sampled: int = 0, num_sampled_drafts: int = 0) -> None:
        """A step's target pass over `num_tokens` (for `num_requests` requests, `num_drafts` of the tokens drafts)
        took `seconds`; `verified`: (drafted, accepted, by rejection sampling) per request whose drafts it verified
        (`request_ids`: theirs, to find tree paths). `num_sampled` of the requests drew a token at temperature > 0,
        `num_sampled_drafts` of the drafts theirs (a sampled row costs more than a greedy one: spec_length.py).
        What `SpeculationLength` chooses the next steps' lengths from."""
        self.length.record_step(num_tokens, seconds, requests=num_requests, drafts=num_drafts,
                                sampled_requests=num_sampled, sampled_drafts=num_sampled_drafts)
        for j, (drafted, accepted, sampled) in enumerate(verified):
            path = self._paths.get(request_ids[j]) if self._paths and j < len(request_ids) else None
            self.length.record_verified(drafted, accepted, path, sampled=sampled)

    def length_stats(self) -> dict[str, float]:
        length = self.length
        return {"spec_num_speculative_tokens": length.k, "spec_acceptance_rate": length.acceptance_rate,
                "spec_mean_accepted_length": length.mean_accepted_length}

    def take_draft_probs(self, requests: Sequence[Request]) -> list[torch.Tensor | None]:
        """The draft probabilities of each request's pending drafts (None: deterministic drafts, or none); taken,
        since a step verifies every draft it schedules."""
        if not self._probs:  # most steps at a large batch: no drafts anywhere
            return [None] * len(requests)
        return [self._probs.pop(r.request_id, None) for r in requests]

    def release(self, request_id: str) -> None:
        self._probs.pop(request_id, None)
        self.speculator.release(request_id)

    def draft_lengths(self, batch: Sequence[Request], num_running: int) -> dict[int, int] | None:
        """How many drafts each of this step's requests gets next step (batch index -> length, those with any), or
        None where the speculator need not even be called: nobody gets drafts and it does not track steps without
        them (`Speculator.sees_steps_without_drafts`). Call `propose` with the result otherwise."""
        # Requests that asked for logprobs get no drafts (verification would need each position's logprobs), nor do
        # those still in their prefill, nor structured ones (their grammar masks each position: see
        # structured_output.py). Whether drafts pay at this batch size is measured (self.length); a user's
        # [speculator] max_batch_size is only a ceiling above that.
        over_ceiling = self.max_batch_size is not None and num_running > self.max_batch_size
        eligible = [] if over_ceiling else [
            i for i, r in enumerate(batch)
            if r.status == RequestStatus.RUNNING and r.params.logprobs is None and r.params.structured is None
            and r.num_computed_tokens == r.num_tokens - 1]
        # How many drafts pay at this batch size (spec_length.py), per request; with none, a speculator that keeps
        # per-request state still sees the step.
        sampled = [not batch[i].params.greedy for i in eligible]  # priced and measured apart (spec_length.py)
        k = self.length.choose(len(eligible), sum(sampled)) if eligible else 0
        lengths = self.length.lengths(len(eligible), sampled) if k else [0] * len(eligible)
        budgets = {i: n for i, n in zip(eligible, lengths, strict=True) if n}
        if not budgets and not self.speculator.sees_steps_without_drafts:
            self._paths = {}
            return None
        return budgets

    def propose(self, batch: Sequence[Request], plan: StepPlan, output: StepOutput, budgets: dict[int, int],
                num_kept: list[int], num_accepted: list[int]) -> None:
        """Ask the speculator for the next drafts of this step's requests (`spec_token_ids`, verified next step),
        `budgets` from `draft_lengths`."""
        eligible = list(budgets)
        k = max(budgets.values(), default=0)
        token_ids, positions, hidden, aux = plan.input_ids, plan.positions, output.hidden_states, \
            output.aux_hidden_states
        if plan.trees:  # each tree request's accepted path first, at its RoPE positions: then it reads as a chain
            order = self._kept_first(batch, plan)
            token_ids, positions = token_ids[order], plan.rope_positions[order]
            on_device = order.to(hidden.device if hidden is not None else "cpu")
            hidden = hidden.index_select(0, on_device) if hidden is not None else None
            aux = {layer: h.index_select(0, on_device.to(h.device)) for layer, h in aux.items()}
        self._paths = {}
        inputs = SpeculatorInputs(
            batch=list(batch), propose_for=eligible, num_speculative_tokens=max(k, 1), token_ids=token_ids,
            positions=positions, query_start_loc=plan.query_start_loc, num_kept=num_kept,
            num_accepted=num_accepted, num_drafts=[len(d) for d in plan.spec_token_ids],
            hidden_states=hidden,
            aux_hidden_states=aux, draft_kv_caches=self.draft_kv_caches, plan=plan,
            block_size=self.speculator.context.block_size)
        started = self.clock()
        proposals = self.speculator.propose(inputs)
        self.length.record_draft(k, self.clock() - started, requests=len(eligible))
        if len(proposals) != len(eligible):
            raise ValueError(f"speculator {type(self.speculator).__name__} returned {len(proposals)} proposals "
                             f"for {len(eligible)} requests")
        for i, proposal in zip(eligible, proposals, strict=True):
            if proposal is None or not proposal.token_ids:
                continue
            req, budget = batch[i], budgets[i]
            room = self.max_model_len - req.num_tokens - 1
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
            parents = proposal.parents
            if parents is not None and not is_chain(parents):
                self._set_tree(req, proposal.token_ids, parents, budget)
                continue
            n = max(0, min(budget, room, len(proposal.token_ids)))
            req.spec_token_ids = [int(t) for t in proposal.token_ids[:n]]
            req.spec_parents = None
            if n and proposal.probs is not None:
                self._probs[req.request_id] = proposal.probs[:n]

    def _set_tree(self, req: Request, token_ids: Sequence[int], parents: Sequence[int], budget: int) -> None:
        """Schedule a tree proposal: at most `budget` nodes (and what the context has slots for), none deeper than
        the tokens the request may still generate (spec_tree.py)."""
        if not self.speculator.drafts_trees:
            raise ValueError(f"speculator {type(self.speculator).__name__} proposed a tree (Proposal.parents) "
                             "without setting drafts_trees, so the attention backend was not checked for it")
        n = max(0, min(budget, self.max_model_len - req.num_tokens - 1, len(token_ids)))
        tokens, tree = [int(t) for t in token_ids[:n]], [int(p) for p in parents[:n]]
        if req.params.max_tokens is not None:
            deepest = req.params.max_tokens - len(req.output_token_ids) - 1
            keep = [d <= deepest for d in depths(tree)]
            if not all(keep):
                tokens = [t for t, kept in zip(tokens, keep, strict=True) if kept]
                tree = prune(tree, keep)
        req.spec_token_ids = tokens
        req.spec_parents = None if is_chain(tree) else tree

    def _kept_first(self, batch: Sequence[Request], plan: StepPlan) -> torch.Tensor:
        """[T] a row order in which each tree request's rows start with its root and accepted path."""
        order = torch.arange(plan.num_tokens)
        starts = plan.query_start_loc
        for i, parents in plan.trees:
            path = self._paths.get(batch[i].request_id)
            if not path:
                continue
            kept = [0, *(1 + node for node in path)]
            rest = [r for r in range(1 + len(parents)) if r not in set(kept)]
            order[starts[i]:starts[i] + 1 + len(parents)] = starts[i] + torch.tensor(kept + rest)
        return order
