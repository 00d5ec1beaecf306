"""A package's hooks.py picks its speculator per hardware (ember_select_speculator): on a CPU the example's Medusa
heads drafting a chain, on a GPU (where a wider pass costs little more) the same heads drafting a tree, on a
machine with few cores no speculation; the real engine then runs the one chosen, says who chose it, and keeps
greedy output exact.

(The choice is among speculators that read the package's `[speculator] model`, or none: a hook that chose one that
ignores it, e.g. ngram, is refused naming speculator.model, as the manifest would be.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from ember import Hardware
from ember.plugins import load_package
from ember_platform import SamplingParams
from ember_platform.engine.engine import LLMEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
HOOKS = '''
from ember import Selection, hookimpl


@hookimpl
def ember_select_speculator(manifest, hardware, available):
    if "medusa" not in available or hardware.cpu_count < 2:
        return Selection("none", reason="no speculation on " + hardware.describe())
    if hardware.is_cuda:  # a pass 16 tokens wider costs little more on a GPU: verify a tree of the heads' top-k
        return Selection("medusa", options={"tree": [3, 2, 1]}, reason="Medusa tree on " + hardware.device_name)
    return Selection("medusa", reason="Medusa chain on " + hardware.device_kind)
'''


def package(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, pkg, ignore=shutil.ignore_patterns("__pycache__", "ember.lock"))
    (pkg / "hooks.py").write_text(HOOKS)
    # The manifest names Medusa and its heads (checked at build); the package's hook, consulted before the manifest's
    # own choice, keeps it on a CPU and picks prompt lookup elsewhere.
    with (pkg / "ember.toml").open("a") as f:
        f.write('\n[speculator]\nmethod = "medusa"\nmodel = "speculator/medusa"\nnum_speculative_tokens = 3\n'
                'adaptive = false\n')
    return pkg


def test_hooks_choose_the_speculator_by_hardware_and_the_engine_runs_it(tmp_path: Path) -> None:
    pkg = package(tmp_path)
    manifest, host = load_package(pkg)
    gpu = Hardware("cuda", "H200", 141 * 2**30, (9, 0), frozenset(), 16, 2**40)
    on_gpu = host.select("speculator", manifest, gpu)
    assert (on_gpu.name, dict(on_gpu.options), on_gpu.reason) == ("medusa", {"tree": [3, 2, 1]}, "Medusa tree on H200")
    one_core = Hardware("cpu", "cpu", 2**33, None, frozenset(), 1, 2**33)
    assert host.select("speculator", manifest, one_core).name == "none"

    engine = LLMEngine(pkg)  # this machine: a CPU
    chosen = engine.selections["speculator"]
    assert chosen.name == "medusa" and chosen.reason == "Medusa chain on cpu" and "hooks.py" in chosen.decided_by
    assert type(engine.speculator).__name__ == "MedusaSpeculator" and engine.speculator.template is None  # a chain
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = "def fibonacci(n):"
    engine.add_request("r", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    plain = LLMEngine(EXAMPLE)
    plain.add_request("r", prompt, params)
    expected: list[int] = []
    while plain.has_unfinished():
        expected += [t for out in plain.step() for t in out.new_token_ids]
    assert tokens == expected
    assert engine.num_draft_tokens > 0 and engine.num_accepted_tokens > 0  # the heads really drafted
