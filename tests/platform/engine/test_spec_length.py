"""The draft length chosen each step from measured acceptance and measured step cost (engine/spec_length.py): drafts
where they pay (a pass bound by reading weights, drafts accepted), none where they would slow decoding down (a pass
bound by compute, or drafts rejected), and the engine really runs with the choice and reports it."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from ember_platform import LLM, SamplingParams
from ember_platform.engine.spec_length import (
    MAX_PROBE_EVERY,
    PLAIN_SPACING,
    PROBE_EVERY,
    PROBE_REQUESTS,
    WARMUP_STEPS,
    SpeculationLength,
    StepCost,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"


def trained(cost: Callable[[int], float], acceptance: float, *, max_k: int = 4, batch: int = 1,
            draft_seconds: float = 0.0) -> SpeculationLength:
    """A controller that has seen steps of every width costing `cost(tokens)` and drafts accepted at `acceptance`
    per position (each draft accepted with that probability once the ones before it were)."""
    length = SpeculationLength(max_k)
    rng = random.Random(0)
    for _ in range(200):
        for k in range(max_k + 1):
            length.record_step(batch * (k + 1), cost(batch * (k + 1)), requests=batch, drafts=batch * k)
            if k:
                length.record_draft(k, draft_seconds * k, requests=batch)
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
    assert chosen.count(4) == 1 and chosen.count(0) == PROBE_EVERY * 2 - 1


def test_probes_back_off_while_they_find_drafts_do_not_pay_and_return_when_the_batch_shrinks() -> None:
    bad = trained(lambda tokens: 0.0005 * tokens, acceptance=0.0, batch=8)
    probes = [i for i in range(40 * PROBE_EVERY) if bad.choose(8) == 4]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    # every probe found nothing pays: each interval twice the one before, up to the ceiling
    assert gaps[:4] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, MAX_PROBE_EVERY]
    assert set(gaps[3:]) == {MAX_PROBE_EVERY}
    # a batch half as large may be one where drafts pay: probed at once
    assert bad.choose(4) == 4


def test_probes_keep_their_interval_while_drafts_pay() -> None:
    flat = trained(lambda tokens: 0.010 + 0.00001 * tokens, acceptance=0.7)
    flat.max_k = 4
    for _ in range(8 * PROBE_EVERY):
        flat.choose(1)
    assert flat._probe_every == PROBE_EVERY


def test_a_few_unlucky_first_drafts_do_not_keep_the_length_short() -> None:
    # Batch 1, a step of 1 ms and 0.2 ms per draft, every draft accepted 80% of the time once the ones before it
    # were: three drafts pay most (2.95 tokens for 1.6 ms, against 1.8 for 1.2 ms with one). But the warm-up's
    # drafts happened to be rejected from the second on, so the second position measures 0.1 after it and one
    # draft looks best. A request drafting one token never measures the second: before the exploring probes only
    # the probe every PROBE_EVERY steps did, and the length stayed at 1 for hundreds of steps.
    length = SpeculationLength(3)
    rng = random.Random(1)
    chosen = []
    for step in range(WARMUP_STEPS + 160):
        k = length.choose(1)
        chosen.append(k)
        drafted = length.lengths(1)[0]
        length.record_step(1 + drafted, 0.001 + 0.0002 * drafted, requests=1, drafts=drafted)
        if step < WARMUP_STEPS:
            accepted = min(drafted, 1)  # the unlucky start
        else:
            accepted = 0
            while accepted < drafted and rng.random() < 0.8:
                accepted += 1
        length.record_verified(drafted, accepted)
    assert 1 in chosen[WARMUP_STEPS:WARMUP_STEPS + 16]  # what the unlucky start measured
    later = chosen[WARMUP_STEPS + 80:]
    assert later.count(3) >= 0.9 * len(later), chosen


def test_a_larger_batch_measures_its_plain_step_before_it_keeps_drafting() -> None:
    # A pass bound by reading the weights (2 ms) until 4 tokens a step, by compute (0.5 ms a token) above: at batch
    # 1 drafts are nearly free, at batch 8 four drafts each cost 5 times a plain step for ~2.8 tokens. Fitted
    # linearly from batch 1's steps (all intercept) a plain step of 8 looks ~8 times batch 1's, and drafting at 8
    # looks as if it paid: before plain steps were kept measured per batch size, it kept drafting at 8 for 64 steps.
    def seconds(tokens: int) -> float:
        return max(0.002, 0.0005 * tokens)

    length = SpeculationLength(4)
    rng = random.Random(2)

    def step(batch: int) -> int:
        k = length.choose(batch)
        drafts = length.lengths(batch)
        length.record_step(batch + sum(drafts), seconds(batch + sum(drafts)), requests=batch, drafts=sum(drafts))
        for drafted in drafts:
            accepted = 0
            while accepted < drafted and rng.random() < 0.7:
                accepted += 1
            length.record_verified(drafted, accepted)
        return k

    at_one = [step(1) for _ in range(300)]
    assert at_one[-100:].count(4) >= 90  # drafts pay at batch 1
    at_eight = [step(8) for _ in range(64)]
    assert 0 in at_eight[:PLAIN_SPACING + 1]  # its plain step measured at once
    assert at_eight[16:].count(0) >= 0.9 * len(at_eight[16:]), at_eight


def test_sampled_requests_are_priced_and_measured_apart_from_greedy_ones() -> None:
    # A step of 10 ms, 0.1 ms a greedy row and 0.5 ms a sampled one (a sampled row is filtered and drawn, a sampled
    # draft verified by rejection sampling), greedy drafts accepted 70% of the time, sampled ones 30%. At a greedy
    # batch of 32 drafts pay. In a batch half sampled they still pay for the greedy half, not for the sampled one:
    # 0.5 ms a draft for 0.3 tokens. With one price for every draft, the greedy batch's cheap drafts were carried
    # into the mixed one, and its sampled requests drafted too (Medusa at 0.80-0.85x on a CPU).
    def seconds(greedy_rows: int, sampled_rows: int) -> float:
        return 0.010 + 0.0001 * greedy_rows + 0.0005 * sampled_rows

    length = SpeculationLength(3)
    rng = random.Random(3)

    def step(flags: list[bool]) -> list[int]:
        length.choose(len(flags), sum(flags))
        drafts = length.lengths(len(flags), flags)
        sampled_drafts = sum(d for d, s in zip(drafts, flags, strict=True) if s)
        length.record_step(len(flags) + sum(drafts),
                           seconds(len(flags) - sum(flags) + sum(drafts) - sampled_drafts, sum(flags) + sampled_drafts),
                           requests=len(flags), drafts=sum(drafts), sampled_requests=sum(flags),
                           sampled_drafts=sampled_drafts)
        for drafted, sampled in zip(drafts, flags, strict=True):
            accepted = 0
            while accepted < drafted and rng.random() < (0.3 if sampled else 0.7):
                accepted += 1
            length.record_verified(drafted, accepted, sampled=sampled)
        return drafts

    greedy = [step([False] * 32) for _ in range(300)]
    assert sum(d[0] >= 2 for d in greedy[-100:]) >= 90  # drafts pay at a greedy batch of 32
    half = [True, False] * 16
    mixed = [step(half) for _ in range(300)][20:]
    sampled_drafts = [d for drafts in mixed for d, s in zip(drafts, half, strict=True) if s]
    greedy_drafts = [d for drafts in mixed for d, s in zip(drafts, half, strict=True) if not s]
    assert sampled_drafts.count(0) >= 0.95 * len(sampled_drafts)  # but for probes, none
    assert sum(d >= 2 for d in greedy_drafts) >= 0.9 * len(greedy_drafts)
    assert length.expected_tokens(3, sampled=True) < length.expected_tokens(3) - 0.5  # measured apart


def test_the_engine_tells_the_chooser_which_requests_sample() -> None:
    # The real engine from a cost model where a sampled request's draft costs 50 times a greedy one's: the greedy
    # requests of a mixed batch keep drafting, the sampled ones stop (but for probes), and greedy output is the same.
    plain = LLM(str(EXAMPLE)).generate([REPETITIVE], SamplingParams(temperature=0, max_tokens=120,
                                                                    ignore_eos=True))[0].token_ids
    spec = LLM(str(EXAMPLE), speculator="ngram", num_speculative_tokens=4, max_num_seqs=8)
    decoder, scheduler = spec.engine.spec, spec.engine.scheduler
    record_step, schedule = decoder.record_step, scheduler.schedule
    drafts = {"greedy": 0, "sampled": 0}
    step = {"greedy": 0, "sampled": 0}  # the drafts of the step being run, from what was scheduled

    def scheduled():  # the scheduler's batch, its drafts counted
        batch = schedule()
        for key in step:
            step[key] = sum(len(r.spec_token_ids) for r in batch.requests if r.params.greedy == (key == "greedy"))
            drafts[key] += step[key]
        return batch

    def record(num_tokens: int, seconds: float, *a, **kw) -> None:
        record_step(num_tokens, 0.010 + 0.0001 * step["greedy"] + 0.005 * step["sampled"], *a, **kw)

    scheduler.schedule = scheduled
    decoder.record_step = record
    decoder.length.record_draft = lambda *a, **kw: None  # prompt lookup: free
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=120, ignore_eos=True) for i in range(8)]
    outputs = spec.generate([REPETITIVE] * 8, params)
    assert [o.token_ids for o in outputs[::2]] == [plain] * 4
    assert drafts["greedy"] > 4 * 50 and drafts["sampled"] < 0.1 * drafts["greedy"], drafts


def test_fixed_length_when_not_adaptive() -> None:
    fixed = SpeculationLength(3, adaptive=False)
    fixed.record_step(4, 1.0, requests=1, drafts=3)
    fixed.record_verified(3, 0)
    assert [fixed.choose(1) for _ in range(20)] == [3] * 20


def test_step_cost_prices_drafts_apart_from_prefill() -> None:
    cost = StepCost()
    assert cost.predict(8, 0) is None
    # A decoding request or a draft costs 1 ms (verified and sampled), a prompt token 0.05 ms, a step 2 ms.
    truth = lambda requests, drafts, prefill: 0.002 + 0.001 * (requests + drafts) + 0.00005 * prefill  # noqa: E731
    for step in range(200):
        requests, drafts, prefill = 32, (0, 0, 6, 32)[step % 4], (0, 180, 0, 0)[step % 4]
        cost.record(truth(requests, drafts, prefill), requests=requests, drafts=drafts, prefill=prefill)
    assert cost.predict(32, 96) == pytest.approx(truth(32, 96, 0), rel=1e-3)  # 3 drafts each: 4x the rows
    assert cost.predict(32, 0, 500) == pytest.approx(truth(32, 0, 500), rel=1e-3)
    assert cost.draft_prices()[0] == pytest.approx(0.001, rel=1e-3)
    cost.record(1.0, requests=0, drafts=0, prefill=4)  # ignored: no request
    cost.record(float("nan"), requests=4, drafts=0, prefill=0)
    assert cost.predict(32, 96) == pytest.approx(truth(32, 96, 0), rel=1e-3)


def test_a_draft_never_measured_is_priced_as_if_compute_bound() -> None:
    # Only plain steps seen: what a draft adds is not measured, so it is priced at the average per token, 1 ms here
    # (the steps cost 2 ms + 1 ms per request), not at 0.
    cost = StepCost()
    for step in range(100):
        cost.record(0.002 + 0.001 * (30 + step % 3), requests=30 + step % 3, drafts=0, prefill=0)
    assert cost.draft_prices()[0] == pytest.approx(0.002 / 31 + 0.001, rel=0.05)


REPETITIVE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"


def test_the_engine_drafts_what_pays_reports_it_and_keeps_greedy_output() -> None:
    # Decided from a pass whose width is nearly free (the real step times would make this depend on the machine's
    # load: a loaded one priced the few drafts of the warm-up as costly, and nothing was drafted after it).
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = LLM(str(EXAMPLE)).generate([REPETITIVE], params)[0].token_ids
    spec, _ = with_cost_model(lambda tokens, requests, drafts: 0.010 + 0.0001 * tokens, 1)
    assert spec.generate([REPETITIVE], params)[0].token_ids == plain  # exact, whatever length was chosen
    stats = spec.engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_mean_accepted_length"] > 1.0
    assert 0 < stats["spec_acceptance_rate"] <= 1
    assert 0 <= stats["spec_num_speculative_tokens"] <= 4
    length = spec.engine.spec.length
    assert length.cost.num_steps > 0 and length.num_verified > 0  # it measured the passes it chose from


Cost = Callable[[int, int, int], float]  # (scheduled tokens, requests, drafts) -> seconds


def with_cost_model(cost: Cost, max_num_seqs: int) -> tuple[LLM, list[int]]:
    """The real engine (ngram, k = 4, no batch-size ceiling) deciding from a deterministic cost model: each step's
    measured seconds are replaced by `cost(...)` of what it scheduled, so the choice depends on nothing but the
    model; and the list of the lengths it chooses."""
    spec = LLM(str(EXAMPLE), speculator="ngram", num_speculative_tokens=4, max_num_seqs=max_num_seqs)
    decoder = spec.engine.spec
    assert decoder.max_batch_size is None  # the default: no static cut-off, the measurement decides
    record_step, choose = decoder.record_step, decoder.length.choose

    def record(num_tokens: int, seconds: float, *a, num_requests: int, num_drafts: int, **kw) -> None:
        record_step(num_tokens, cost(num_tokens, num_requests, num_drafts), *a, num_requests=num_requests,
                    num_drafts=num_drafts, **kw)

    decoder.record_step = record
    decoder.length.record_draft = lambda *a, **kw: None  # prompt lookup: free
    chosen: list[int] = []
    decoder.length.choose = lambda *a, **kw: chosen.append(choose(*a, **kw)) or chosen[-1]  # type: ignore[func-returns-value]
    return spec, chosen


def run_with_cost_model(cost: Cost, num_requests: int) -> tuple[LLM, list[int], list[list[int]]]:
    spec, chosen = with_cost_model(cost, num_requests)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    return spec, chosen, [o.token_ids for o in spec.generate([REPETITIVE] * num_requests, params)]


@pytest.mark.parametrize("batch", [1, 16])
def test_the_engine_stops_drafting_where_a_cost_model_says_it_does_not_pay(batch: int) -> None:
    plain = LLM(str(EXAMPLE)).generate([REPETITIVE], SamplingParams(temperature=0, max_tokens=120,
                                                                    ignore_eos=True))[0].token_ids
    # Weight-bound (a pass costs the same whatever its width): the drafts, mostly accepted on this prompt, pay.
    _, flat, outputs = run_with_cost_model(lambda tokens, *_: 0.010, batch)
    assert outputs == [plain] * batch
    steady = flat[WARMUP_STEPS + 1:]
    assert steady.count(4) >= 0.8 * len(steady), flat
    # Compute-bound (cost in proportion to tokens): k + 1 times the cost for fewer than k + 1 tokens never pays,
    # at batch 1 as at 16: k falls to 0 but for the periodic probes, and greedy output is unchanged.
    spec, proportional, outputs = run_with_cost_model(lambda tokens, *_: 0.001 * tokens, batch)
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
        # compute-bound: drafts cost what they would save and more
        length.record_step(1 + k, 0.001 * (1 + k), requests=1, drafts=k)
        length.record_verified(k, min(k, 2))
    assert chosen[:WARMUP_STEPS] == [4] * WARMUP_STEPS
    assert chosen[WARMUP_STEPS:] == [0] * 40  # the first to measure a plain pass, the rest because it is faster


def stream(llm: LLM, prompts: list[str], in_flight: int) -> list[list[int]]:
    """Serve `prompts` greedily with `in_flight` requests running, a new one admitted as one finishes (outputs of
    varied lengths): most steps then carry a new prompt's prefill next to the decoding requests, as in serving."""
    engine = llm.engine
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    running = 0
    while pending or running:
        while pending and running < in_flight:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6 + (i * 7) % 31,
                                                               ignore_eos=True))
            outputs[f"r{i}"] = []
            running += 1
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                engine.forget(out.request_id)
                running -= 1
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_cheap_prefill_tokens_do_not_make_wide_decode_steps_look_cheap() -> None:
    # Prompts of 30 to 300 tokens arriving all the time among 12 decoding requests. A prompt token costs 0.02 ms
    # (it runs through the layers in a batch, no LM head, no sampling), a decoding request or a draft 1 ms: a step
    # with drafts is as much wider as it has drafts, which never pays. Priced by token count alone, the steps with
    # a prompt chunk (200 tokens for a few ms) made a decode step of 60 tokens look cheap, and k stayed at 4.
    prompts = [f"# {i}\n" + REPETITIVE * (1 + i % 7) for i in range(48)]  # distinct: no prefix cache hits
    plain = stream(LLM(str(EXAMPLE), max_num_seqs=12), prompts, 12)
    steps: list[tuple[int, int, int]] = []

    def compute_bound(tokens: int, requests: int, drafts: int) -> float:
        steps.append((tokens, requests, drafts))
        return 0.001 * (requests + drafts) + 0.00002 * (tokens - requests - drafts)

    spec, chosen = with_cost_model(compute_bound, 12)
    assert stream(spec, prompts, 12) == plain  # exact, whatever length was chosen
    assert sum(tokens - requests - drafts >= 20 for tokens, requests, drafts in steps) >= len(steps) // 4  # prompts
    steady = chosen[WARMUP_STEPS:]
    # probes only: every PROBE_EVERY steps at most, and once each time the batch halves as the last requests finish
    assert steady.count(0) >= len(steady) - len(steady) // PROBE_EVERY - 1 - math.ceil(math.log2(12)), chosen
    # The same workload where a wider pass is nearly free (a GPU at this batch): the drafts pay, k stays high.
    spec, chosen = with_cost_model(lambda tokens, requests, drafts: 0.010 + 0.00002 * (tokens - requests - drafts),
                                   12)
    assert stream(spec, prompts, 12) == plain
    steady = chosen[WARMUP_STEPS:]
    assert steady.count(4) >= 0.8 * len(steady), chosen


def test_a_speculator_that_needs_no_steps_without_drafts_is_not_called_on_them() -> None:
    # ngram declares sees_steps_without_drafts = False: above the ceiling (2 running, max_batch_size 1) nobody gets
    # drafts, and the engine skips the call altogether; once one request is left, it is called and drafts.
    llm = LLM(str(EXAMPLE), speculator="ngram", num_speculative_tokens=4, speculator_max_batch_size=1,
              speculator_adaptive=False)
    engine = llm.engine
    assert not engine.speculator.sees_steps_without_drafts
    calls: list[int] = []
    propose = engine.speculator.propose
    engine.speculator.propose = lambda inputs: (calls.append(len(inputs.propose_for)), propose(inputs))[1]
    engine.add_request("long", REPETITIVE, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("short", REPETITIVE + "#", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # a speculator that sees every step would be called with propose_for = [] on the steps with both running
    assert calls and all(n == 1 for n in calls)
    assert engine.num_draft_tokens > 0


def test_the_fits_small_solver_agrees_with_lapack() -> None:
    # The fit's 3-4 unknowns are solved in plain Python (a numpy call's set-up cost more than the arithmetic).
    import numpy as np

    from ember_platform.engine.spec_length import _solve_small

    rng = np.random.default_rng(0)
    for n in (3, 4) * 50:
        m = rng.normal(size=(n, n)) * 10.0 ** rng.uniform(-2, 2, size=n)
        a, b = m @ m.T + np.eye(n) * 1e-3, rng.normal(size=n)
        x = _solve_small([list(row) for row in a], list(b))
        assert np.allclose(x, np.linalg.solve(a, b), rtol=1e-6, atol=1e-9)
