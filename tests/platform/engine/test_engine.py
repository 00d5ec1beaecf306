"""The engine end to end on the example package: equal to transformers, and batching, prefix
caching, chunking and preemption never change a greedy result."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.engine import LLMEngine

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0, shared: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 4096) for _ in range(shared)]
    return [system[: rng.choice([0, shared])] + [rng.randrange(5, 4096) for _ in range(rng.randrange(3, 60))]
            for _ in range(n)]


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    """Each prompt generated alone, with nothing else in the engine."""
    llm = LLM(EXAMPLE, enable_prefix_caching=False)
    return {tuple(p): llm.generate([p], GREEDY)[0].token_ids for p in prompts(32)}


def test_greedy_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(EXAMPLE / "weights", dtype=torch.float32)
    llm = LLM(EXAMPLE)
    for prompt in prompts(3, seed=7):
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0].token_ids
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        assert ours == theirs.tolist()


@pytest.mark.parametrize("overrides", [
    {},  # a batch of 32 with prefix caching
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 32, "max_num_seqs": 8},  # chunked prefill at a tiny budget
    {"num_kv_blocks": 24},  # a tiny pool: preemption
], ids=["batch32", "no-prefix-cache", "tiny-budget", "tiny-pool"])
def test_batching_is_invisible(reference, overrides) -> None:
    engine = LLMEngine(EXAMPLE, **overrides)
    ps = prompts(32)
    pending = list(enumerate(ps))
    results: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), 1 + step % 3)):  # staggered arrivals
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        for out in engine.step():
            results.setdefault(int(out.request_id), []).extend(out.new_token_ids)
        step += 1
    assert all(results[i] == reference[tuple(p)] for i, p in enumerate(ps))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_tiny_pool_preempts() -> None:
    engine = LLMEngine(EXAMPLE, num_kv_blocks=24)
    for i, p in enumerate(prompts(16)):
        engine.add_request(str(i), p, GREEDY)
    preempted = 0
    while engine.has_unfinished():
        engine.step()
        preempted = max(preempted, max((r.num_preemptions for r in engine.scheduler.running), default=0))
    assert preempted > 0 and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_hit_skips_prefill() -> None:
    llm = LLM(EXAMPLE)
    shared = prompts(1, seed=3, shared=0)[0] * 3  # > 2 blocks
    first = llm.generate([[*shared, 7, 8]], GREEDY)[0]
    second = llm.generate([[*shared, 9, 10]], GREEDY)[0]
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == (len(shared) // 16) * 16


def test_prompt_of_a_request_finished_in_its_prefill_step_is_cached() -> None:
    llm = LLM(EXAMPLE)
    shared = prompts(1, seed=4, shared=0)[0] * 2
    llm.generate([[*shared, 1]], SamplingParams(temperature=0, max_tokens=1))  # finishes in the prefill step
    hit = llm.generate([[*shared, 2]], GREEDY)[0]
    assert hit.usage.cached_tokens == (len(shared) // 16) * 16 > 0


def test_auto_dtype_on_cpu_follows_bf16_support() -> None:
    from ember_platform.engine.engine import resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, cpu, native_bf16=False) == torch.float32
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, cpu, native_bf16=True) == torch.bfloat16
    assert resolve_dtype("bfloat16", {"dtype": "float32"}, cpu, native_bf16=False) == torch.bfloat16


def test_seeded_sampling_reproduces_in_any_batch() -> None:
    llm = LLM(EXAMPLE)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)
    alone = llm.generate([[11, 12, 13]], params)[0].token_ids
    noise = [SamplingParams(temperature=1.0, max_tokens=16)] * 5
    batch = llm.generate([[5, 6]] * 3 + [[11, 12, 13]] + [[7]] * 2, [*noise[:3], params, *noise[3:]])
    assert batch[3].token_ids == alone
    assert llm.generate([[11, 12, 13]], SamplingParams(temperature=0.8, seed=99, max_tokens=16))[0].token_ids != alone


def test_stop_string_split_across_tokens() -> None:
    llm = LLM(EXAMPLE)
    full = llm.generate([[20, 21, 22]], GREEDY)[0]
    assert len(full.text) > 6
    stop = full.text[3:7]  # very likely spans a token boundary; must stop either way
    out = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]


def test_abort_returns_every_block() -> None:
    engine = LLMEngine(EXAMPLE)
    for i, p in enumerate(prompts(8)):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    assert engine.kv.num_free_blocks < engine.kv.num_blocks
    for i in range(8):
        engine.abort(str(i))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished()


def test_ngram_speculation_is_exact_for_greedy() -> None:
    code = list(range(100, 140)) * 3  # repetitive, so prompt lookup has something to propose
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(EXAMPLE).generate([code], params)[0].token_ids
    spec = LLM(EXAMPLE, speculator="ngram", num_speculative_tokens=4)
    assert spec.generate([code], params)[0].token_ids == plain
    assert spec.engine.num_draft_tokens > 0


def test_int8_mostly_agrees() -> None:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = prompts(1, seed=5)[0]
    full = LLM(EXAMPLE).generate([prompt], params)[0].token_ids
    q = LLM(EXAMPLE, quantization="int8").generate([prompt], params)[0].token_ids
    agree = next((i for i, (a, b) in enumerate(zip(full, q, strict=True)) if a != b), len(full))
    assert agree >= 8, f"int8 diverged after {agree} tokens"


def test_invalid_prompt_is_refused() -> None:
    engine = LLMEngine(EXAMPLE)
    with pytest.raises(ValueError, match=r"prompt: .* the model's context is 2048 tokens"):
        engine.add_request("x", [5] * 2048)
    with pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 4096\)"):
        engine.add_request("y", [99999])


def test_unknown_override_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq' \\(did you mean 'max_num_seqs'\\?\\)"):
        LLM(EXAMPLE, max_num_seq=4)
