"""The `ngram` speculator: which drafts it proposes (longest n first, cycles continued, an adaptive
budget), and that speculation never changes a greedy result through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.request import Request
from ember_platform.engine.speculation import SpeculatorContext, SpeculatorInputs
from ember_plugins.speculators.ngram import NgramSpeculator, continuation

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def speculator(**options: object) -> NgramSpeculator:
    context = SpeculatorContext(num_speculative_tokens=4, vocab_size=4096, device=torch.device("cpu"),
                                dtype=torch.float32)
    return NgramSpeculator(options, context)


def request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, GREEDY, arrival=0)


def drafts(spec: NgramSpeculator, req: Request, k: int = 4, verified: tuple[int, int] = (0, 0)) -> list[int] | None:
    # The engine's per-step input as ngram reads it: the requests to propose for, k, and (drafts verified this
    # step, drafts accepted); no hidden states.
    empty = torch.empty(0, dtype=torch.long)
    inputs = SpeculatorInputs(batch=[req], propose_for=[0], num_speculative_tokens=k, token_ids=empty,
                              positions=empty, query_start_loc=[0, 0], num_kept=[0], num_accepted=[verified[1]],
                              num_drafts=[verified[0]])
    proposal = spec.propose(inputs)[0]
    return None if proposal is None else proposal.token_ids


def test_proposes_what_followed_the_latest_match() -> None:
    spec = speculator(adaptive=False)
    # [1 2 3] occurs twice before the end; the latest occurrence is followed by 7 8 9 ...
    assert drafts(spec, request([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 10, 11, 1, 2, 3])) == [7, 8, 9, 10]


def test_prefers_the_longest_ngram() -> None:
    spec = speculator(adaptive=False, min_ngram=1, max_ngram=3)
    # The latest "3" is followed by 9, but only the earlier "2 3" matches two tokens: it wins.
    assert drafts(spec, request([2, 3, 4, 5, 6, 3, 9, 9, 9, 2, 3]))[:2] == [4, 5]


def test_no_match_no_proposal() -> None:
    assert drafts(speculator(), request([1, 2, 3, 4, 5, 6])) is None


def test_a_one_token_loop_proposes_k_tokens() -> None:
    spec = speculator(adaptive=False)
    # Before the fix only the single token after the latest match (one period back) was proposed.
    assert drafts(spec, request([5, 6, 7, 7, 7, 7])) == [7, 7, 7, 7]


def test_a_short_cycle_is_continued_period_by_period() -> None:
    spec = speculator(adaptive=False)
    # "a b c" repeating: the latest match of the last 4 tokens is one period (3 tokens) back.
    assert drafts(spec, request([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]), k=7) == [2, 3, 1, 2, 3, 1, 2]


@pytest.mark.parametrize(("tokens", "follow", "k", "expected"), [
    ([1, 2, 3, 4, 1, 2], 2, 4, [3, 4, 1, 2]),  # a whole period left: no repetition needed
    ([1, 2, 3, 4, 1, 2], 5, 3, [2, 2, 2]),  # period 1
    ([1, 2, 3, 4, 1, 2], 4, 5, [1, 2, 1, 2, 1]),  # period 2, cut at k
    ([1, 2, 3, 4, 5, 6], 1, 2, [2, 3]),  # the match is far back: just the next k
])
def test_continuation(tokens: list[int], follow: int, k: int, expected: list[int]) -> None:
    assert continuation(tokens, follow, k) == expected


def test_adaptive_budget_shrinks_on_rejection_and_grows_on_acceptance() -> None:
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert drafts(spec, req) == [3, 4, 5, 6]  # nothing known yet: the full k
    req.output_token_ids += [9, 1, 2]  # the first draft rejected (the target chose 9), then two plain steps
    assert drafts(spec, req) == [9]  # mean accepted 0: a single draft
    req.output_token_ids += [9, 1]  # accepted, plus the target's own token
    assert drafts(spec, req) == [2, 9]  # mean (0 + 1) / 2 = 0.5: ceil + 1 = 2 drafts
    req.output_token_ids += [2, 9, 1]  # both accepted
    assert drafts(spec, req) == [2, 9, 1]  # mean (0.5 + 2) / 2 = 1.25: 3 drafts


def test_adaptive_budget_uses_the_engines_acceptance_count() -> None:
    spec = speculator()
    req = request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert drafts(spec, req) == [3, 4, 5, 6]
    req.output_token_ids += [9, 1, 2]
    # Comparing these tokens with the drafts would say 0 accepted; the engine's count (3 of 4 verified) is what the
    # budget follows when it has one: mean 3, so ceil + 1 = 4 drafts next.
    assert drafts(spec, req, verified=(4, 3)) == [9, 1, 2, 9]  # 4 drafts (comparing tokens: mean 0, 1 draft)
    assert spec._states["r"].mean_accepted == 3


def test_not_adaptive_always_proposes_k() -> None:
    spec = speculator(adaptive=False)
    req = request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert len(drafts(spec, req)) == 4
    req.output_token_ids += [9, 1, 2]
    assert len(drafts(spec, req)) == 4


def test_state_restarts_when_a_request_is_recomputed() -> None:
    spec = speculator(adaptive=False)
    req = request([1, 2, 3, 1, 2])
    assert drafts(spec, req) == [3, 1, 2, 3]
    # The same id reused for a shorter, different request: the old tokens must not leak into the search.
    assert drafts(spec, request([4, 5, 4, 5])) == [4, 5, 4, 5]
    spec.release("r")
    assert "r" not in spec._states


def test_invalid_ngram_range_is_refused() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        speculator(min_ngram=3, max_ngram=2)


@pytest.mark.parametrize("options", [{}, {"adaptive": False, "min_ngram": 1}], ids=["default", "fixed-k-unigram"])
def test_speculation_is_exact_for_greedy_through_the_engine(options: dict[str, object]) -> None:
    # A repetitive prompt (so drafts are proposed and partly rejected) and a short cycle at its end.
    code = list(range(100, 140)) * 3 + [7, 8] * 6
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(EXAMPLE).generate([code], params)[0].token_ids
    spec = LLM(EXAMPLE, speculator="ngram", num_speculative_tokens=5, speculator_options=options)
    assert spec.generate([code], params)[0].token_ids == plain
    assert spec.engine.num_draft_tokens > 0
