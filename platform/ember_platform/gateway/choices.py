"""Several choices per prompt (`n`, and `best_of` candidates) as engine requests, and back into OpenAI's choices.

One body fans out into `len(prompts) * candidates` engine requests, laid out prompt by prompt: candidate j of prompt
i is item `i * candidates + j`, which is also its choice index when every candidate is returned (OpenAI numbers the
choices of a multi-prompt completion that way). Candidate 0 of each prompt is its prefill leader: the others wait for
it and read the prompt's KV blocks from the prefix cache (LLMEngine.add_request's `share_prefill_with`).

Torch-free: the HTTP layer's modules import this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ember_platform.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember_platform.gateway.responses import Generation

# OpenAI and vLLM accept up to 128 choices (and best_of candidates) per prompt.
MAX_CHOICES = 128


@dataclass(frozen=True, slots=True)
class FanOut:
    """The engine requests of one body: prompts and params per item, and the item whose prefill each shares."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    leaders: list[int | None]  # per item: the item index it waits for, None for a prompt's first candidate
    candidates: int  # engine requests per prompt


def sibling_params(params: SamplingParams, j: int) -> SamplingParams:
    """Candidate j's settings: a seeded request's siblings draw from seed + j, so that the choices differ and a
    request sent again gets them back (candidate 0 keeps the seed: n=1 and the first of n choices agree)."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + j)


def fan_out(prompts: Sequence[list[int]], params: Sequence[SamplingParams], candidates: int) -> FanOut:
    """`candidates` engine requests per prompt (`params[i]` is prompt i's)."""
    items: list[list[int]] = []
    item_params: list[SamplingParams] = []
    leaders: list[int | None] = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        for j in range(candidates):
            items.append(prompt)
            item_params.append(sibling_params(p, j))
            leaders.append(None if j == 0 else i * candidates)
    return FanOut(items, item_params, leaders, candidates)


def cumulative_logprob(generation: Generation) -> float:
    """The sum of the sampled tokens' logprobs (the model's raw distribution): how likely the whole choice is."""
    return sum(lp.logprob for lp in generation.logprobs)


def best_of(generations: Sequence[Generation], candidates: int, n: int) -> list[Generation]:
    """For each prompt's `candidates` generations (consecutive), its `n` with the highest cumulative logprob, most
    likely first, as vLLM orders them; a prompt's choices stay together, in prompt order."""
    if candidates == n:
        return list(generations)
    chosen: list[Generation] = []
    for start in range(0, len(generations), candidates):
        group = generations[start:start + candidates]
        chosen += sorted(group, key=cumulative_logprob, reverse=True)[:n]
    return chosen
