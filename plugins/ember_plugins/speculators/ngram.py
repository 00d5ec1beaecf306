"""`ngram` speculation (prompt lookup): no draft model at all.

Code, retrieval answers and edits repeat their context. When the last n tokens occurred
earlier in the sequence, the tokens that followed that occurrence are a good guess for what
comes next. We search from n = `max_ngram` down to `min_ngram` and take the latest earlier
occurrence of the longest n that matches, proposing up to k tokens that followed it.

The search runs on the token ids packed as uint32 bytes, so `bytes.rfind` does it in C.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember_platform.api import Proposal, Request, Speculator, SpeculatorContext, SpeculatorInputs


@dataclass(slots=True)
class _RequestState:
    """What the speculator keeps per request: its tokens packed for `rfind`, and its last proposal."""

    packed: array = field(default_factory=lambda: array("I"))
    count: int = 0  # tokens of the request already in `packed`
    proposed: list[int] = field(default_factory=list)  # the last drafts, made when the request had `count` tokens
    mean_accepted: float | None = None  # running mean of drafts accepted per step (None: nothing proposed yet)


def continuation(tokens: Sequence[int], follow: int, k: int) -> list[int]:
    """Up to k tokens that continue `tokens` the way they continued after position `follow`.

    When the match is within k tokens of the end, the text is in a cycle of period
    `len(tokens) - follow` (the last n tokens equal the n tokens before `follow`); if it keeps
    cycling, what comes after the known tail is the tail again, so we repeat it up to k tokens
    instead of proposing only the short tail (1 token per step for a one-token loop).
    """
    tail = list(tokens[follow:follow + k])
    period = len(tokens) - follow
    if 0 < period < k:
        tail = (tail * (k // period + 1))[:k]
    return tail


class NgramSpeculator(Speculator):
    """Options: `min_ngram` (default 2) and `max_ngram` (default 4), the n-gram lengths tried, longest
    first; `adaptive` (default true): propose, per request, about one token more than it has recently
    been accepting, rather than always k."""

    # Between drafts it needs nothing: each request's n-gram index catches up from the request's tokens.
    sees_steps_without_drafts = False

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        super().__init__(options, context)
        self.min_ngram = int(self.options.get("min_ngram", 2))
        self.max_ngram = int(self.options.get("max_ngram", 4))
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"[speculator] options: need 1 <= min_ngram ({self.min_ngram}) <= max_ngram "
                             f"({self.max_ngram})")
        self.adaptive = bool(self.options.get("adaptive", True))
        self._states: dict[str, _RequestState] = {}

    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        k = inputs.num_speculative_tokens
        # The engine says how many of the drafts it verified this step the target accepted; where it verified none
        # (or does not say), the new tokens are compared with the last proposal instead.
        verified = inputs.num_drafts or [0] * len(inputs.batch)
        return [self._propose_one(inputs.batch[i], k, inputs.num_accepted[i] if verified[i] else None)
                for i in inputs.propose_for]

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _state(self, req: Request) -> _RequestState:
        state = self._states.get(req.request_id)
        if state is None or state.count > req.num_tokens:  # new, recomputed after preemption, or reused id
            state = self._states[req.request_id] = _RequestState()
        return state

    def _update(self, state: _RequestState, req: Request, accepted: int | None = None) -> None:
        """Append the request's new tokens; score the last proposal (`accepted`: what the engine counted)."""
        old_count = state.count
        if old_count < req.num_prompt_tokens:
            state.packed.extend(req.prompt_token_ids[old_count:])
            old_count = req.num_prompt_tokens
        new = req.output_token_ids[old_count - req.num_prompt_tokens:]
        state.packed.extend(new)
        state.count = req.num_tokens
        if state.proposed and new:
            if accepted is None:
                # The step that verified our drafts kept the longest agreeing prefix, plus one token of the
                # target's own; that token may happen to equal our next draft, hence the cap.
                accepted = 0
                for draft, token in zip(state.proposed, new, strict=False):
                    if draft != token:
                        break
                    accepted += 1
                accepted = min(accepted, len(new) - 1)
            # Halve the weight of the past each step: a request's text switches between repetitive
            # stretches and novel ones within a few tokens.
            prev = state.mean_accepted
            state.mean_accepted = accepted if prev is None else (prev + accepted) / 2
        state.proposed = []

    def _budget(self, state: _RequestState, k: int) -> int:
        """How many drafts to propose: each draft costs a row of the verifying forward pass, and on
        CPUs small-batch matmuls cost about a row's worth each; about one more than recently accepted
        keeps the accepted ones and grows by one per step while they all are."""
        if not self.adaptive or state.mean_accepted is None:
            return k
        return max(1, min(k, math.ceil(state.mean_accepted) + 1))

    def _propose_one(self, req: Request, k: int, accepted: int | None = None) -> Proposal | None:
        state = self._state(req)
        self._update(state, req, accepted)
        tokens = state.packed
        n_total = len(tokens)
        haystack = tokens.tobytes()
        budget = self._budget(state, k)
        for n in range(min(self.max_ngram, n_total - 1), self.min_ngram - 1, -1):
            needle = haystack[(n_total - n) * 4:]
            # Search only matches that end before the last token, so at least one token follows.
            hi = (n_total - 1) * 4
            while (pos := haystack.rfind(needle, 0, hi)) >= 0:
                if pos % 4 == 0:  # aligned on a token boundary: a real n-gram match
                    state.proposed = continuation(tokens, pos // 4 + n, budget)
                    return Proposal(list(state.proposed))
                hi = pos + len(needle) - 1  # a match straddling tokens: look further left
        return None
