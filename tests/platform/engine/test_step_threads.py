"""Small steps on one thread or torch's, whichever measured faster (step_threads.py): both sides are timed before a
choice, torch's thread count is back after every step, large steps are never touched, and the engine's decode steps
go through it with the same tokens either way."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine import step_threads
from ember_platform.engine.step_threads import StepThreads

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_size_groups() -> None:
    assert [StepThreads.group_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert StepThreads.group_of(17) is None


def test_the_faster_side_is_chosen_after_both_are_measured(two_threads: None) -> None:
    choice = StepThreads(enabled=True)
    seen = []
    for _ in range(2 * step_threads.SAMPLES):
        with choice.running(1):
            seen.append(torch.get_num_threads())
            if torch.get_num_threads() == 2:
                time.sleep(0.002)  # two threads made slow: one must win
        assert torch.get_num_threads() == 2  # restored after every step
    assert sorted(seen) == [1] * step_threads.SAMPLES + [2] * step_threads.SAMPLES  # alternating, both measured
    assert choice.chosen(1) == 1
    with choice.running(1):
        assert torch.get_num_threads() == 1
    assert choice.chosen(2) is None  # another size group measures on its own


def test_large_steps_and_a_disabled_choice_keep_torch_s_threads(two_threads: None) -> None:
    for choice, tokens in ((StepThreads(enabled=True), step_threads.MAX_TOKENS + 1), (StepThreads(enabled=False), 1)):
        for _ in range(4 * step_threads.SAMPLES):
            with choice.running(tokens):
                assert torch.get_num_threads() == 2
        assert choice.chosen(tokens) is None


def test_a_step_that_raises_still_restores_the_threads(two_threads: None) -> None:
    choice = StepThreads(enabled=True)
    with pytest.raises(RuntimeError), choice.running(1):
        assert torch.get_num_threads() == 1  # the first step measures one thread
        raise RuntimeError("the forward failed")
    assert torch.get_num_threads() == 2


def test_the_engine_runs_its_decode_steps_through_the_choice_with_the_same_tokens(two_threads: None) -> None:
    params = SamplingParams(max_tokens=4 * step_threads.SAMPLES + 4, temperature=0.0, ignore_eos=True)
    prompt = ["def parse(line):\n    return"]
    measured = LLM(EXAMPLE)
    assert measured.engine.step_threads.enabled  # a CPU engine whose forward runs in this process
    unmeasured = LLM(EXAMPLE)
    unmeasured.engine.step_threads.enabled = False
    got, want = measured.generate(prompt, params)[0], unmeasured.generate(prompt, params)[0]
    assert got.token_ids == want.token_ids
    assert measured.engine.step_threads.chosen(1) in (1, 2)  # one-token decode steps: measured and chosen
    assert unmeasured.engine.step_threads.chosen(1) is None
