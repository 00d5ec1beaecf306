"""The draft length chosen each step from measured acceptance and measured step cost (engine/spec_length.py): drafts
where they pay (a pass bound by reading weights, drafts accepted), none where they would slow decoding down (a pass
bound by compute, or drafts rejected), and the engine really runs with the choice and reports it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from ember_platform import LLM, SamplingParams
from ember_platform.engine.spec_length import PROBE_EVERY, PROBE_REQUESTS, WARMUP_STEPS, SpeculationLength, StepCost

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"


def trained(cost: Callable[[int], float], acceptance: float, *, max_k: int = 4, batch: int = 1,
            draft_seconds: float = 0.0) -> SpeculationLength:
    """A controller that has seen steps of every width costing `cost(tokens)` and drafts accepted at `acceptance`
    per position (each draft accepted with that probability once the ones before it were)."""
    length = SpeculationLength(max_k)
    rng = random.Random(0)
    for _ in range(200):
        for k in range(max_k + 1):
            length.record_step(batch * (k + 1), cost(batch * (k + 1)))
            if k:
                length.record_draft(k, draft_seconds * k)
        for _ in range(batch):
            accepted = 0
            while accepted < max_k and rng.random() < acceptance:
                accepted += 1
            length.record_verified(max_k, accepted)
    length._steps = WARMUP_STEPS + 1  # past the warm-up; the probes are tested on their own
    return length


def test_a_pass_bound_by_reading_weights_drafts_the_full_length() -> None:
    flat = trained(lambda tokens: 0.010 + 0.00001 * tokens, acceptance=0.7)
    assert flat.choose(1) == 4
    assert flat.expected_tokens(4) == pytest.approx(1 + 0.7 + 0.49 + 0.343 + 0.2401, abs=0.35)


def test_a_pass_bound_by_compute_drafts_nothing() -> None:
    # 32 requests: a pass costs in proportion to its tokens, so k drafts cost k+1 times as much, and 70% acceptance
    # gives at most ~2.8 tokens for 5 times the cost.
    proportional = trained(lambda tokens: 0.0005 * tokens, acceptance=0.7, batch=32)
    assert proportional.choose(32) == 0


def test_rejected_drafts_are_not_worth_even_a_cheap_pass() -> None:
    assert trained(lambda tokens: 0.010 + 0.0005 * tokens, acceptance=0.0).choose(1) == 0


def test_in_between_the_length_is_where_the_rate_peaks() -> None:
    # Each draft costs 30% of a one-token pass: at 60% acceptance the third and fourth drafts no longer pay.
    length = trained(lambda tokens: 0.010 + 0.003 * (tokens - 1), acceptance=0.6)
    k = length.choose(1)
    rates = [length.expected_tokens(j) / (0.010 + 0.003 * j) for j in range(5)]
    assert 0 < k < 4 and k == rates.index(max(rates))


def test_the_drafters_own_time_counts() -> None:
    cheap = trained(lambda tokens: 0.010, acceptance=0.6)
    costly = trained(lambda tokens: 0.010, acceptance=0.6, draft_seconds=0.006)  # a draft model: 6 ms per token
    assert cheap.choose(1) == 4 and costly.choose(1) < 4


def test_warm_up_and_probes_draft_the_full_length_to_keep_measuring() -> None:
    length = SpeculationLength(4)
    assert [length.choose(8) for _ in range(WARMUP_STEPS)] == [4] * WARMUP_STEPS  # nothing measured yet
    bad = trained(lambda tokens: 0.0005 * tokens, acceptance=0.0, batch=8)
    chosen = [bad.choose(8) for _ in range(PROBE_EVERY * 2)]
    assert chosen.count(4) == 2 and chosen.count(0) == PROBE_EVERY * 2 - 2


def test_fixed_length_when_not_adaptive() -> None:
    fixed = SpeculationLength(3, adaptive=False)
    fixed.record_step(4, 1.0)
    fixed.record_verified(3, 0)
    assert [fixed.choose(1) for _ in range(20)] == [3] * 20


def test_step_cost_interpolates_and_extrapolates_pessimistically() -> None:
    cost = StepCost()
    assert cost.predict(8) is None
    cost.record(2, 0.002)
    cost.record(8, 0.004)
    assert cost.predict(1) == pytest.approx(0.002)  # below what was measured: at least the smallest pass
    assert cost.predict(5) == pytest.approx(0.003)
    assert cost.predict(32) == pytest.approx(0.016)  # 4x the largest measured size: 4x its time
    cost.record(0, 1.0)  # ignored: no tokens
    cost.record(4, float("nan"))
    assert cost.predict(5) == pytest.approx(0.003)


REPETITIVE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


def test_the_engine_drafts_what_pays_reports_it_and_keeps_greedy_output() -> None:
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(str(EXAMPLE)).generate([REPETITIVE], params)[0].token_ids
    spec = LLM(str(EXAMPLE), speculator="ngram", num_speculative_tokens=4)
    assert spec.generate([REPETITIVE], params)[0].token_ids == plain  # exact, whatever length was chosen
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_mean_accepted_length"] > 1.0
    assert 0 < stats["spec_acceptance_rate"] <= 1
    assert 0 <= stats["spec_num_speculative_tokens"] <= 4
    length = spec.engine.spec.length
    assert length.cost.measured(1) and length.num_verified > 0  # it measured the passes it chose from


def run_with_cost_model(cost: Callable[[int], float], num_requests: int) -> tuple[LLM, list[int], list[list[int]]]:
    """The real engine (ngram, k = 4, no batch-size ceiling) deciding from a deterministic cost model: each step's
    measured seconds are replaced by `cost(scheduled tokens)`, so the choice depends on nothing but the model."""
    spec = LLM(str(EXAMPLE), speculator="ngram", num_speculative_tokens=4, max_num_seqs=num_requests)
    decoder = spec.engine.spec
    assert decoder.max_batch_size is None  # the default: no static cut-off, the measurement decides
    record_step, choose = decoder.record_step, decoder.length.choose
    decoder.record_step = lambda num_tokens, seconds, *a, **kw: record_step(num_tokens, cost(num_tokens), *a, **kw)
    decoder.length.record_draft = lambda k, seconds: None  # prompt lookup: free
    chosen: list[int] = []
    decoder.length.choose = lambda *a, **kw: chosen.append(choose(*a, **kw)) or chosen[-1]  # type: ignore[func-returns-value]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    return spec, chosen, [o.token_ids for o in spec.generate([REPETITIVE] * num_requests, params)]


@pytest.mark.parametrize("batch", [1, 16])
def test_the_engine_stops_drafting_where_a_cost_model_says_it_does_not_pay(batch: int) -> None:
    plain = LLM(str(EXAMPLE)).generate([REPETITIVE], SamplingParams(temperature=0, max_tokens=120,
                                                                    ignore_eos=True))[0].token_ids
    # Weight-bound (a pass costs the same whatever its width): the drafts, mostly accepted on this prompt, pay.
    _, flat, outputs = run_with_cost_model(lambda tokens: 0.010, batch)
    assert outputs == [plain] * batch
    steady = flat[WARMUP_STEPS + 1:]
    assert steady.count(4) >= 0.8 * len(steady), flat
    # Compute-bound (cost in proportion to tokens): k + 1 times the cost for fewer than k + 1 tokens never pays,
    # at batch 1 as at 16: k falls to 0 but for the periodic probes, and greedy output is unchanged.
    spec, proportional, outputs = run_with_cost_model(lambda tokens: 0.001 * tokens, batch)
    assert outputs == [plain] * batch
    steady = proportional[WARMUP_STEPS:]
    assert steady.count(0) >= len(steady) - len(steady) // PROBE_EVERY - 1, proportional
    assert spec.engine.stats()["spec_num_speculative_tokens"] == 0
    # and its warm-up and probe steps draft for PROBE_REQUESTS requests, not the whole batch
    probes = WARMUP_STEPS + len(proportional) // PROBE_EVERY + 1
    assert spec.engine.num_draft_tokens <= probes * min(batch, PROBE_REQUESTS) * 4


def test_a_plain_pass_is_measured_before_drafting_is_judged_free() -> None:
    # A speculator that always drafts the full k (Medusa) leaves only wide passes measured after the warm-up; below
    # the narrowest measured width the cost model assumes that width's cost, so without a plain step to compare
    # with, drafting would look free forever.
    length = SpeculationLength(4)
    chosen = []
    for _ in range(WARMUP_STEPS + 40):
        k = length.choose(1)
        chosen.append(k)
        length.record_step(1 + k, 0.001 * (1 + k))  # compute-bound: drafts cost what they would save and more
        length.record_verified(k, min(k, 2))
    assert chosen[:WARMUP_STEPS] == [4] * WARMUP_STEPS
    assert chosen[WARMUP_STEPS:] == [0] * 40  # the first to measure a plain pass, the rest because it is faster
