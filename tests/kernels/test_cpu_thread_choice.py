"""`ThreadChoice` (kernels/ember_kernels/cpu/threads.py): a small call runs on whichever of one thread and torch's
this machine measures faster for its shape, re-measured now and then; large calls always get torch's threads; and
the kernels that use it compute the same bits either way."""

from __future__ import annotations

import time

import pytest
import torch

from ember_kernels.cpu import threads as threads_module
from ember_kernels.cpu.threads import REFRESH, SAMPLES, SMALL_ROWS, ThreadChoice


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def sleeper(seconds_by_threads: dict[int, float], seen: list[int]):
    def call(value: int, num_threads: int) -> int:
        seen.append(num_threads)
        time.sleep(seconds_by_threads[num_threads])
        return value
    return call


@pytest.mark.parametrize(("costs", "winner"), [({1: 0.0, 2: 0.004}, 1), ({1: 0.004, 2: 0.0}, 2)])
def test_the_faster_side_is_measured_then_kept(two_threads: None, costs: dict[int, float], winner: int) -> None:
    choice, seen = ThreadChoice(), []
    call = sleeper(costs, seen)
    for _ in range(2 * SAMPLES + 10):
        assert choice.run("shape", 1, call, 7) == 7  # the call's own result, whatever ran it
    assert seen[:2 * SAMPLES].count(1) == SAMPLES and seen[:2 * SAMPLES].count(2) == SAMPLES  # both measured
    assert set(seen[2 * SAMPLES:]) == {winner} and choice.chosen("shape") == winner


def test_shapes_are_measured_apart_and_large_calls_keep_torchs_threads(two_threads: None) -> None:
    choice, seen = ThreadChoice(), []
    one_wins, two_win = sleeper({1: 0.0, 2: 0.003}, seen), sleeper({1: 0.003, 2: 0.0}, seen)
    for _ in range(2 * SAMPLES):
        choice.run("a", 1, one_wins, 0)
        choice.run("b", 1, two_win, 0)
    assert (choice.chosen("a"), choice.chosen("b")) == (1, 2)
    seen.clear()
    for _ in range(5):
        choice.run("c", SMALL_ROWS + 1, one_wins, 0)  # a prefill chunk: never run on one thread to measure it
    assert seen == [2] * 5 and choice.chosen("c") is None


def test_the_choice_is_measured_again_after_refresh_calls(two_threads: None) -> None:
    choice, seen = ThreadChoice(), []
    costs = {1: 0.0, 2: 0.003}
    call = sleeper(costs, seen)
    for _ in range(2 * SAMPLES):
        choice.run("shape", 1, call, 0)
    assert choice.chosen("shape") == 1
    costs[1], costs[2] = 0.003, 0.0  # the machine changed (load, policy)
    for _ in range(REFRESH + 2 * SAMPLES):
        choice.run("shape", 1, call, 0)
    assert choice.chosen("shape") == 2


def test_one_torch_thread_is_never_measured() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        choice, seen = ThreadChoice(), []
        for _ in range(4):
            choice.run("shape", 1, sleeper({1: 0.0}, seen), 0)
        assert seen == [1] * 4 and choice.chosen("shape", 1) is None
    finally:
        torch.set_num_threads(before)


def test_the_native_linears_give_the_same_bits_on_one_thread_or_two(two_threads: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from ember_kernels.cpu.dense_linear import dense_linear, dense_linear_available
    from ember_kernels.cpu.int4_linear import int4_linear, int4_pack
    from ember_kernels.cpu.int8_linear import int8_linear

    if not dense_linear_available():
        pytest.skip("no native kernels here")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen)
    weight = torch.randn(300, 256, generator=gen)
    q8 = torch.randint(-127, 128, (300, 256), dtype=torch.int8, generator=gen)
    scale = torch.rand(300, generator=gen)
    packed = int4_pack(torch.randint(0, 16, (300, 256), dtype=torch.uint8, generator=gen),
                       torch.rand(300, 2, generator=gen), torch.full((300, 2), 8.0), 128)
    outputs = {}
    for forced in (1, 2):
        monkeypatch.setattr(threads_module.THREADS, "run", lambda key, rows, fn, *args, n=forced: fn(*args, n))
        outputs[forced] = (dense_linear(x, weight), int8_linear(x, q8, scale), int4_linear(x, *packed, 300, 128))
    for one, two in zip(outputs[1], outputs[2], strict=True):
        assert torch.equal(one, two)


def test_the_engines_decode_linears_run_through_the_choice(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The example model (float32: the native dense linear) decoding one request: every linear's call of one row
    # goes through the choice, and after a few tokens each such shape has a thread count chosen. A fresh
    # ThreadChoice: the process-wide one carries other tests' calls (a refresh could be under way).
    from pathlib import Path

    from ember_kernels.cpu import dense_linear as dense_module
    from ember_platform import LLM, SamplingParams

    if not dense_module.dense_linear_available():
        pytest.skip("no native kernels here")
    fresh = ThreadChoice()
    monkeypatch.setattr(dense_module, "THREADS", fresh)
    llm = LLM(Path(__file__).resolve().parents[2] / "examples" / "tiny-llama")
    # The engine's own choice of a step's threads (step_threads.py) would run every decode step on one thread
    # wherever one measures faster, and the linears' choice is only made for calls under two: steps on torch's.
    llm.engine.step_threads.enabled = False
    llm.generate([list(range(100, 120))], [SamplingParams(temperature=0, max_tokens=2 * SAMPLES + 4, ignore_eos=True)])
    decode = [key for key, threads in fresh._shapes if key[0] == "dense_linear" and key[2] == 1 and threads == 2]
    assert len(decode) >= 4  # qkv, o, gate_up, down (and the LM head)
    assert all(fresh.chosen(key, 2) in (1, 2) for key in decode)
