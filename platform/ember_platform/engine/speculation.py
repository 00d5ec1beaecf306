"""The speculator interface (documented engine API for speculator plugins) and verification.

A speculator proposes up to k draft tokens per request; the engine feeds them to the target
model together with the request's newest token, in one pass, and keeps the longest prefix the
target agrees with plus one token of its own. The scheduler only ever sees
`request.spec_token_ids`, so proposers of any kind fit without changing it:

* prompt lookup (`ngram`): deterministic, no model — `Proposal.probs` is None;
* a draft model: returns its distributions in `Proposal.probs` so that rejection sampling keeps
  the target's distribution exactly at temperature > 0;
* Medusa / EAGLE heads: set `uses_hidden_states = True` and read the target's last hidden state
  for each request from `SpeculatorContext.hidden_states` (filled by the model runner).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ember_platform.engine.request import Request


@dataclass(slots=True)
class Proposal:
    """Draft tokens for one request; `probs` [k, V] is the draft distribution, or None when the
    proposer is deterministic (then it is the point mass on each token)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(slots=True)
class SpeculatorContext:
    """What a speculator may need to set itself up and to propose."""

    num_speculative_tokens: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    model_dir: Path | None = None  # the package's [speculator] model directory, if any
    target_config: Mapping[str, Any] = field(default_factory=dict)
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [D], if asked


class Speculator(ABC):
    """Proposes draft tokens. Subclasses are registered with `ember_speculators`."""

    uses_hidden_states: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, Any], context: SpeculatorContext) -> None:
        self.options = dict(options)
        self.context = context

    @abstractmethod
    def propose(self, requests: Sequence[Request], num_tokens: int) -> list[Proposal | None]:
        """Up to `num_tokens` drafts for each request (None or an empty proposal: no drafts)."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional: proposers with state free it
        """Forget a finished request (draft models free its draft KV here)."""


def verify_greedy(target_ids: Sequence[int], draft_ids: Sequence[int]) -> list[int]:
    """Greedy verification: `target_ids` are the target's choices at each of the k+1 positions.

    Accept drafts while they equal the target's choice; then add the target's own token. The
    result is exactly what greedy decoding without speculation would have produced.
    """
    accepted = []
    for i, draft in enumerate(draft_ids):
        if target_ids[i] != draft:
            break
        accepted.append(draft)
    accepted.append(target_ids[len(accepted)])
    return accepted


def verify_rejection(target_probs: torch.Tensor, draft_ids: Sequence[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """Rejection sampling (Leviathan et al.): the output follows `target_probs` exactly.

    target_probs: [k+1, V] the target's processed distribution at each position;
    draft_probs: [k, V], or None for a deterministic proposer (a point mass on each draft).
    """
    k = len(draft_ids)
    device = target_probs.device
    uniforms = torch.rand(k + 1, generator=generator, device=device) if k else None
    accepted: list[int] = []
    for i, x in enumerate(draft_ids):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        assert uniforms is not None
        if q_x > 0 and float(uniforms[i]) < min(1.0, float(p[x]) / q_x):
            accepted.append(x)
            continue
        # Rejected: resample from the residual max(0, p - q), renormalized.
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0)
        total = residual.sum()
        residual = residual / total if total > 0 else p
        accepted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return accepted
    accepted.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return accepted
