"""n choices of one prompt share its prefill (siblings wait for the first, then hit the prefix cache), and logit_bias
moves the sampler's choice (a +100 bias forces a token, -100 bans it), greedy and sampled."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ember_platform import SamplingParams
from ember_platform.engine.engine import LLMEngine
from ember_platform.engine.sampler import Sampler, SamplingBatch
from ember_platform.engine.sampling_params import SamplingParamsError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
BLOCK = 16  # the example's kv_block_size
PROMPT = [random.Random(3).randrange(5, 4096) for _ in range(2 * BLOCK + 8)]  # two full blocks and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EXAMPLE)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, str | None]]
        ) -> tuple[dict[str, list[int]], dict[str, int], dict[str, int]]:
    """Add every request at once, step to the end: (tokens, prompt tokens computed, cached tokens) per request."""
    computed: dict[str, int] = {}
    schedule = engine.scheduler.schedule

    def observed_schedule():  # what each step computes, read off the real scheduler's batch
        batch = schedule()
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            prompt_left = max(0, req.num_prompt_tokens - req.num_computed_tokens)  # hits already counted in
            computed[req.request_id] = computed.get(req.request_id, 0) + min(n, prompt_left)
        return batch

    engine.scheduler.schedule = observed_schedule
    try:
        for request_id, prompt, params, leader in requests:
            engine.add_request(request_id, prompt, params, share_prefill_with=leader)
        tokens: dict[str, list[int]] = {r[0]: [] for r in requests}
        cached: dict[str, int] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    cached[out.request_id] = out.usage.cached_tokens
                    engine.forget(out.request_id)
    finally:
        engine.scheduler.schedule = schedule
    return tokens, computed, cached


def fresh_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4096) for _ in range(2 * BLOCK + 8)]


def test_siblings_wait_for_the_first_prefill_and_read_its_full_blocks_from_the_prefix_cache(engine) -> None:
    prompt = fresh_prompt(11)  # not cached by an earlier test
    before = engine.stats()
    tokens, computed, cached = run(engine, [("a", prompt, GREEDY, None), ("b", prompt, GREEDY, "a"),
                                            ("c", prompt, GREEDY, "a")])
    after = engine.stats()
    partial = len(prompt) - 2 * BLOCK
    # The prompt's two full blocks are computed once (by the leader); each sibling computes the partial block only.
    assert computed == {"a": len(prompt), "b": partial, "c": partial}
    assert cached == {"a": 0, "b": 2 * BLOCK, "c": 2 * BLOCK}
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 4 * BLOCK
    assert after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"] == 3 * len(prompt)
    assert tokens["a"] == tokens["b"] == tokens["c"] and len(tokens["a"]) == 6  # greedy: n identical choices


def test_without_a_leader_the_same_prompts_all_compute_their_prefill_in_one_step(engine) -> None:
    prompt = fresh_prompt(12)
    before = engine.stats()
    tokens, computed, cached = run(engine, [("a", prompt, GREEDY, None), ("b", prompt, GREEDY, None)])
    assert computed == {"a": len(prompt), "b": len(prompt)} and cached == {"a": 0, "b": 0}
    assert engine.stats()["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"]
    shared, _, _ = run(engine, [("c", fresh_prompt(13), GREEDY, None), ("d", fresh_prompt(13), GREEDY, "c")])
    assert tokens["a"] == tokens["b"] and shared["c"] == shared["d"]


def test_a_leader_with_another_prompt_or_a_short_prompt_holds_nobody(engine) -> None:
    other, short = fresh_prompt(14), fresh_prompt(15)[:BLOCK]  # short: no whole block before its last token
    _, computed, _ = run(engine, [("a", fresh_prompt(16), GREEDY, None), ("b", other, GREEDY, "a"),
                                  ("c", short, GREEDY, None), ("d", short, GREEDY, "c")])
    assert computed == {"a": len(other), "b": len(other), "c": BLOCK, "d": BLOCK}


def test_seeded_siblings_sample_their_own_streams_reproducibly(engine) -> None:
    prompt = fresh_prompt(17)

    def sample() -> list[list[int]]:
        requests = [(f"s{j}", prompt, SamplingParams(temperature=1.0, seed=100 + j, max_tokens=8, ignore_eos=True),
                     None if j == 0 else "s0") for j in range(3)]
        tokens, _, _ = run(engine, requests)
        return [tokens[f"s{j}"] for j in range(3)]

    first = sample()
    assert len({tuple(t) for t in first}) == 3  # three seeds, three different choices
    assert sample() == first


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled(engine) -> None:
    prompt = fresh_prompt(18)
    plain, _, _ = run(engine, [("plain", prompt, GREEDY, None)])
    favourite = plain["plain"][0]
    forced_id = 1234 if favourite != 1234 else 1235
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced_id: 100})
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logit_bias={forced_id: 100})
    banned = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias={favourite: -100})
    tokens, _, _ = run(engine, [("forced", prompt, forced, None), ("sampled", prompt, sampled, None),
                                ("banned", prompt, banned, None), ("plain2", prompt, GREEDY, None)])
    assert tokens["forced"] == [forced_id] * 6 and tokens["sampled"] == [forced_id] * 6
    assert tokens["banned"][0] != favourite
    assert tokens["plain2"] == plain["plain"]  # a neighbour's bias never leaks into another row


def test_logit_bias_is_added_to_the_logits_of_its_row_only() -> None:
    logits = torch.zeros(2, 8)
    logits[:, 3] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={6: 7.5, 3: -2.0}), SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, vocab_size=8)
    processed = Sampler().process_logits(logits, batch)
    expected = logits.clone()
    expected[0, 6] += 7.5
    expected[0, 3] -= 2.0
    assert torch.equal(processed, expected)
    assert Sampler().sample(logits, batch).token_ids.tolist() == [6, 3]


def test_logit_bias_values_and_ids_are_checked(engine) -> None:
    assert SamplingParams(logit_bias={9: 1, 7: -2.5}).logit_bias == ((7, -2.5), (9, 1.0))
    with pytest.raises(SamplingParamsError, match=r"in \[-100, 100\]") as e:
        SamplingParams(logit_bias={7: 101})
    assert e.value.field == "logit_bias"
    with pytest.raises(SamplingParamsError, match="at most 300"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, 4096\)"):
        engine.add_request("too-far", [5, 6, 7], SamplingParams(logit_bias={4096: 1.0}))


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 16, "max_num_seqs": 4}],
                         ids=["one-step", "chunked"])
def test_prompt_logprobs_are_the_models_and_never_come_from_the_prefix_cache(overrides) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EXAMPLE, **overrides)
    prompt = fresh_prompt(19)
    run(engine, [("warm", prompt, GREEDY, None)])  # the prompt is in the prefix cache now
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    engine.add_request("p", prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    first = outputs[0]
    assert first.usage.cached_tokens == 0 and all(out.prompt_logprobs is None for out in outputs[1:])
    hf = AutoModelForCausalLM.from_pretrained(EXAMPLE / "weights", dtype=torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt[1:]
    for t, lp in enumerate(first.prompt_logprobs):
        assert lp.logprob == pytest.approx(expected[t, prompt[t + 1]].item(), abs=1e-4)
        top = expected[t].topk(3)
        assert [i for i, _ in lp.top] == top.indices.tolist()


def test_siblings_of_a_prompt_already_cached_start_in_the_leaders_step(engine) -> None:
    prompt = fresh_prompt(20)
    run(engine, [("warm", prompt, GREEDY, None)])
    schedule = engine.scheduler.schedule
    first_step: list[str] = []

    def observed_schedule():
        batch = schedule()
        if not first_step:
            first_step.extend(r.request_id for r in batch.requests)
        return batch

    engine.scheduler.schedule = observed_schedule
    try:
        _, computed, cached = run(engine, [("a", prompt, GREEDY, None), ("b", prompt, GREEDY, "a")])
    finally:
        engine.scheduler.schedule = schedule
    assert first_step == ["a", "b"]  # no step spent waiting: the leader found the blocks in the cache
    assert cached == {"a": 2 * BLOCK, "b": 2 * BLOCK}
    assert computed == {"a": len(prompt) - 2 * BLOCK, "b": len(prompt) - 2 * BLOCK}
