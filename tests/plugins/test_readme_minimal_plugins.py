"""README's smallest parallel strategy and speculator (the `ember-minimal` distribution, built from README.md and
installed for real): the engine runs its steps through the plugin's executor and verifies the plugin's drafts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ember_platform import LLM, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["def f(x):", "x = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0"]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [out.token_ids for out in LLM(str(EXAMPLE)).generate(PROMPTS, GREEDY)]


def test_the_engine_runs_every_step_through_the_plugin_s_executor(use_plugins, plain) -> None:
    use_plugins("minimal")
    llm = LLM(str(EXAMPLE), parallelism="step-count")
    executor = type(llm.engine.executor)
    assert executor.__module__ == "ember_minimal.executor" and llm.engine.selections["parallelism"].name == "step-count"
    steps, tokens = executor.num_steps, executor.num_tokens
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == plain
    assert executor.num_steps - steps >= GREEDY.max_tokens  # at least one step a token
    assert executor.num_tokens - tokens >= sum(len(ids) for ids in plain)


def test_the_engine_verifies_the_plugin_s_drafts_and_keeps_the_target_s_output(use_plugins, plain) -> None:
    use_plugins("minimal")
    llm = LLM(str(EXAMPLE), speculator="echo", num_speculative_tokens=3)
    assert type(llm.engine.speculator).__module__ == "ember_minimal.echo"
    assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == plain
    assert llm.engine.num_accepted_tokens > 0, "no draft was ever accepted (both answers repeat themselves)"


def test_the_plugin_s_entry_module_imports_no_torch(use_plugins) -> None:
    import subprocess

    use_plugins("minimal")
    site = next(p for p in sys.path if p.endswith("site-minimal"))
    code = "import ember_minimal, sys; assert 'torch' not in sys.modules, 'torch imported at entry'"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": site, "PATH": "/usr/bin:/bin"})
