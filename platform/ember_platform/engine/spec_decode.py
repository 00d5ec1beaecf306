"""The engine core's side of speculative decoding: what each step's plan must return for the speculator
(hidden states, aux layers), the per-step `SpeculatorInputs`, the drafts it proposes (cut to what the
request has room for), and their draft probabilities, kept until the target verifies them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ember_platform.engine.request import Request, RequestStatus
from ember_platform.engine.spec_length import SpeculationLength
from ember_platform.engine.speculation import Speculator, SpeculatorInputs
from ember_platform.engine.step_plan import StepOutput, StepPlan


class SpecDecoder:
    """Drives one speculator for an engine."""

    def __init__(self, speculator: Speculator, *, num_speculative_tokens: int, max_batch_size: int,
                 max_model_len: int, num_layers: int, adaptive: bool = True) -> None:
        self.speculator = speculator
        self.k = num_speculative_tokens
        self.length = SpeculationLength(num_speculative_tokens, adaptive=adaptive)
        self.max_batch_size = max_batch_size
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

    def record_step(self, num_tokens: int, seconds: float, verified: Sequence[tuple[int, int]]) -> None:
        """A step's target pass over `num_tokens` took `seconds`; `verified`: (drafted, accepted) per request whose
        drafts it verified. What `SpeculationLength` chooses the next steps' draft lengths from."""
        self.length.record_step(num_tokens, seconds)
        for drafted, accepted in verified:
            self.length.record_verified(drafted, accepted)

    def length_stats(self) -> dict[str, float]:
        length = self.length
        return {"spec_num_speculative_tokens": length.k, "spec_acceptance_rate": length.acceptance_rate,
                "spec_mean_accepted_length": length.mean_accepted_length}

    def take_draft_probs(self, requests: Sequence[Request]) -> list[torch.Tensor | None]:
        """The draft probabilities of each request's pending drafts (None: deterministic drafts, or none); taken,
        since a step verifies every draft it schedules."""
        return [self._probs.pop(r.request_id, None) for r in requests]

    def release(self, request_id: str) -> None:
        self._probs.pop(request_id, None)
        self.speculator.release(request_id)

    def propose(self, batch: Sequence[Request], plan: StepPlan, output: StepOutput, num_kept: list[int],
                num_accepted: list[int], num_running: int) -> None:
        """Ask the speculator for the next drafts of this step's requests (`spec_token_ids`, verified next step)."""
        # Large batches are compute-bound: drafts would cost more than they save. Requests that asked for logprobs
        # get none (verification would need each position's logprobs), nor do those still in their prefill, nor
        # structured ones (their grammar masks each position: see structured_output.py).
        eligible = [i for i, r in enumerate(batch)
                    if r.status == RequestStatus.RUNNING and r.params.logprobs is None and r.params.structured is None
                    and r.num_computed_tokens == r.num_tokens - 1] if num_running <= self.max_batch_size else []
        # How many drafts pay at this batch size (spec_length.py); with none, the speculator still sees the step.
        other_tokens = plan.num_tokens - sum(plan.query_lens[i] for i in eligible)  # prefill chunks, mostly
        k = self.length.choose(len(eligible), other_tokens) if eligible else 0
        if k == 0:
            eligible = []
        inputs = SpeculatorInputs(
            batch=list(batch), propose_for=eligible, num_speculative_tokens=max(k, 1), token_ids=plan.input_ids,
            positions=plan.positions, query_start_loc=plan.query_start_loc, num_kept=num_kept,
            num_accepted=num_accepted, num_drafts=[len(d) for d in plan.spec_token_ids],
            hidden_states=output.hidden_states,
            aux_hidden_states=output.aux_hidden_states, draft_kv_caches=self.draft_kv_caches, plan=plan,
            block_size=self.speculator.context.block_size)
        started = time.perf_counter()
        proposals = self.speculator.propose(inputs)
        self.length.record_draft(k, time.perf_counter() - started)
        if len(proposals) != len(eligible):
            raise ValueError(f"speculator {type(self.speculator).__name__} returned {len(proposals)} proposals "
                             f"for {len(eligible)} requests")
        for i, proposal in zip(eligible, proposals, strict=True):
            if proposal is None or not proposal.token_ids:
                continue
            req = batch[i]
            room = self.max_model_len - req.num_tokens - 1
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
            n = max(0, min(k, room, len(proposal.token_ids)))
            req.spec_token_ids = [int(t) for t in proposal.token_ids[:n]]
            if n and proposal.probs is not None:
                self._probs[req.request_id] = proposal.probs[:n]
