"""`ngram` speculation (prompt lookup): no draft model at all.

Code, retrieval answers and edits repeat their context. When the last n tokens occurred
earlier in the sequence, the tokens that followed that occurrence are a good guess for what
comes next. We search from n = `max_ngram` down to `min_ngram` and take the latest earlier
occurrence, proposing up to k tokens that followed it.

The search runs on the token ids packed as uint32 bytes, so `bytes.rfind` does it in C.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from ember_platform.engine.request import Request
from ember_platform.engine.speculation import Proposal, Speculator, SpeculatorContext


class NgramSpeculator(Speculator):
    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        super().__init__(options, context)
        self.min_ngram = int(self.options.get("min_ngram", 2))
        self.max_ngram = int(self.options.get("max_ngram", 4))
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"[speculator] options: need 1 <= min_ngram ({self.min_ngram}) <= max_ngram "
                             f"({self.max_ngram})")
        self._packed: dict[str, tuple[array, int]] = {}  # request id -> (uint32 tokens, count)

    def propose(self, requests: Sequence[Request], num_tokens: int) -> list[Proposal | None]:
        return [self._propose_one(req, num_tokens) for req in requests]

    def release(self, request_id: str) -> None:
        self._packed.pop(request_id, None)

    def _tokens(self, req: Request) -> array:
        packed, count = self._packed.get(req.request_id, (array("I"), 0))
        if count > req.num_tokens:  # recomputed after preemption, or reused id: start over
            packed, count = array("I"), 0
        if count < req.num_prompt_tokens:
            packed.extend(req.prompt_token_ids[count:])
            count = req.num_prompt_tokens
        packed.extend(req.output_token_ids[count - req.num_prompt_tokens:])
        self._packed[req.request_id] = (packed, req.num_tokens)
        return packed

    def _propose_one(self, req: Request, k: int) -> Proposal | None:
        tokens = self._tokens(req)
        n_total = len(tokens)
        haystack = tokens.tobytes()
        for n in range(min(self.max_ngram, n_total - 1), self.min_ngram - 1, -1):
            needle = haystack[(n_total - n) * 4:]
            # Search only matches that end before the last token, so at least one token follows.
            hi = (n_total - 1) * 4
            while (pos := haystack.rfind(needle, 0, hi)) >= 0:
                if pos % 4 == 0:  # aligned on a token boundary: a real n-gram match
                    follow = pos // 4 + n
                    return Proposal(tokens[follow:follow + k].tolist())
                hi = pos + len(needle) - 1  # a match straddling tokens: look further left
        return None
