"""One request that breaks the engine fails alone: the others in its batch finish as if it had not been there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.engine import MAX_CONSECUTIVE_FORWARD_FAILURES, EngineBrokenError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 77, 300, 9] * 4, [6, 78, 301, 10] * 4, [7, 79, 302, 11] * 4]


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.set_num_threads(1)
    return LLM(EXAMPLE, max_num_seqs=8)


def test_stop_token_ids_outside_the_vocabulary_are_refused_when_added(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[llm.engine.vocab_size + 7])
    with pytest.raises(ValueError, match=r"stop_token_ids: token ids must be in \[0, 4096\), got 4103"):
        llm.engine.add_request("bad", PROMPTS[0], params)
    assert not llm.engine.has_unfinished()


def test_a_request_that_breaks_the_sampler_fails_alone(llm: LLM) -> None:
    engine = llm.engine
    alone = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    free_before = engine.kv.num_free_blocks
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"iso-{i}", prompt, GREEDY)
    # What validation at the edge would have refused, as if it had been missed: the sampler indexes the
    # vocabulary with stop ids while min_tokens holds them back (the crash that killed replicas).
    poisoned = engine.scheduler.requests["iso-1"]
    poisoned.params = SamplingParams(temperature=0, max_tokens=8, min_tokens=4, ignore_eos=True,
                                     stop_token_ids=[engine.vocab_size + 1000])
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple[str | None, str | None]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error)
                engine.forget(out.request_id)
    assert finished["iso-1"][0] == "error" and "sampling failed" in (finished["iso-1"][1] or "")
    assert tokens.get("iso-1", []) == []
    assert [tokens["iso-0"], tokens["iso-2"]] == [alone[0], alone[2]]
    assert finished["iso-0"] == ("length", None) and finished["iso-2"] == ("length", None)
    assert engine.kv.num_free_blocks == free_before  # the failed request's blocks went back too
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == alone  # and the engine serves on


def test_forward_failures_fail_their_requests_and_only_repeated_ones_break_the_engine(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    real_execute = engine.executor.execute
    failures = {"left": 1}

    def flaky(batch):  # a fault injected into the real forward pass: the first call raises as a device error would
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected device failure")
        return real_execute(batch)

    monkeypatch.setattr(engine.executor, "execute", flaky)
    first = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert first.finish_reason == "error" and "forward pass" in (first.error or "")
    again = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 8  # one failure is survived

    failures["left"] = MAX_CONSECUTIVE_FORWARD_FAILURES
    with pytest.raises(EngineBrokenError):
        for i in range(MAX_CONSECUTIVE_FORWARD_FAILURES):
            engine.add_request(f"broken-{i}", PROMPTS[0], GREEDY)
            engine.step()
