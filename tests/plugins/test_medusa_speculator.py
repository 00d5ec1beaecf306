"""`medusa`: trained heads on the example model draft through its LM head; greedy output is exactly the target's
(alone, in a batch, under preemption), the drafts are really accepted, and bad head directories are refused with the
setting named."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from ember_platform import LLM, SamplingParams
from ember_platform.engine.engine import LLMEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
HEADS = "speculator/medusa"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n    path = os.path.",
           "class Stack:\n    def __init__(self):", "for i in range(10):\n    print(i)\nfor j in range(10):\n"]


def medusa(**overrides: object) -> LLM:
    return LLM(str(EXAMPLE), speculator="medusa", speculator_model=HEADS,
               **{"num_speculative_tokens": 3, "speculator_adaptive": False, **overrides})


@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [out.token_ids for out in LLM(str(EXAMPLE)).generate(PROMPTS, params)]


def test_greedy_output_is_the_targets_and_drafts_are_accepted(plain_outputs: list[list[int]]) -> None:
    llm = medusa()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == plain_outputs  # batch 1
    assert [out.token_ids for out in llm.generate(PROMPTS, params)] == plain_outputs  # one batch
    stats = llm.engine.stats()
    # The heads were trained (examples/train_medusa.py): drafts are accepted (on short prompts like these the first
    # head agrees with the target about a third of the time; on its own longer continuations, three quarters).
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] > 0.1
    assert stats["spec_mean_accepted_length"] > 1.3


def test_greedy_output_survives_preemption(plain_outputs: list[list[int]],
                                           run_preempted: Callable[..., list[list[int]]]) -> None:
    # 9 blocks of 16 tokens cannot hold 4 requests of up to ~60 tokens each: the newest are preempted and recomputed.
    engine = LLMEngine(EXAMPLE, speculator="medusa", speculator_model=HEADS, num_speculative_tokens=3,
                       speculator_adaptive=False, num_kv_blocks=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert run_preempted(engine, PROMPTS, params) == plain_outputs


def test_sampled_requests_mix_with_greedy_ones_in_a_batch(plain_outputs: list[list[int]]) -> None:
    llm = medusa()
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [greedy, sampled, greedy, sampled])
    assert outputs[0].token_ids == plain_outputs[0] and outputs[2].token_ids == plain_outputs[2]
    assert all(len(out.token_ids) == 40 for out in outputs)


def copy_heads(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, package, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def test_heads_for_another_model_or_too_few_are_refused(tmp_path: Path) -> None:
    package = copy_heads(tmp_path)
    config_path = package / HEADS / "config.json"
    config = json.loads(config_path.read_text())
    with pytest.raises(ValueError, match="num_speculative_tokens: 5 drafts need as many Medusa heads"):
        LLM(str(package), speculator="medusa", speculator_model=HEADS, num_speculative_tokens=5)
    config_path.write_text(json.dumps({**config, "hidden_size": 512}))
    with pytest.raises(ValueError, match="trained for hidden_size 512, the model has 256"):
        LLM(str(package), speculator="medusa", speculator_model=HEADS, num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"speculator\.model: medusa needs the directory of its Medusa heads"):
        LLM(str(package), speculator="medusa", num_speculative_tokens=2)
    config_path.write_text(json.dumps(config))


# --- tree verification (options.tree) ---------------------------------------------------------------------

TREE = [3, 2, 1]  # 3 + 6 + 6 = 15 nodes


def medusa_tree(**overrides: object) -> LLM:
    return medusa(num_speculative_tokens=15, speculator_options={"tree": TREE}, **overrides)


def test_tree_greedy_output_is_the_targets_and_accepts_more_than_the_chain(plain_outputs: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    chain = medusa()
    assert [out.token_ids for out in chain.generate(PROMPTS, params)] == plain_outputs
    llm = medusa_tree()
    assert llm.engine.speculator.drafts_trees
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS] == plain_outputs  # batch 1
    assert [out.token_ids for out in llm.generate(PROMPTS, params)] == plain_outputs  # one batch
    # The tree's other branches catch what the top-1 chain misses (measured: 2.14 vs 1.58 on these prompts).
    tree_len = llm.engine.stats()["spec_mean_accepted_length"]
    assert tree_len > chain.engine.stats()["spec_mean_accepted_length"] + 0.2
    assert llm.engine.spec.num_tree_moves > 0  # accepted paths off the first branch were moved into place


def test_tree_greedy_output_in_a_batch_of_32(plain_outputs: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = medusa_tree(speculator_max_batch_size=32, max_num_seqs=32)
    outputs = llm.generate(PROMPTS * 8, params)
    assert [out.token_ids for out in outputs] == plain_outputs * 8
    assert llm.engine.stats()["spec_mean_accepted_length"] > 1.5


def test_tree_greedy_output_survives_preemption(plain_outputs: list[list[int]],
                                                run_preempted: Callable[..., list[list[int]]]) -> None:
    engine = LLMEngine(EXAMPLE, speculator="medusa", speculator_model=HEADS, num_speculative_tokens=15,
                       speculator_options={"tree": TREE}, speculator_adaptive=False, num_kv_blocks=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert run_preempted(engine, PROMPTS, params) == plain_outputs


def test_tree_sampled_requests_mix_with_greedy_ones(plain_outputs: list[list[int]]) -> None:
    llm = medusa_tree(speculator_adaptive=True)  # the adaptive node budget too
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [greedy, sampled, greedy, sampled])
    assert outputs[0].token_ids == plain_outputs[0] and outputs[2].token_ids == plain_outputs[2]
    assert all(len(out.token_ids) == 40 for out in outputs)


@pytest.mark.parametrize(("tree", "k", "message"), [
    ([4, 0], 2, r"speculator\.options\.tree must be a non-empty list of positive integers"),
    ("3,2", 2, r"speculator\.options\.tree must be a non-empty list of positive integers"),
    ([], 2, r"speculator\.options\.tree must be a non-empty list"),
    ([True, 2], 2, r"speculator\.options\.tree must be a non-empty list"),
    ([2, 2, 2, 2, 2], 2, r"speculator\.options\.tree: \[2, 2, 2, 2, 2\] needs 5 Medusa heads; .* has 4"),
    ([2, 1], 5, r"speculator\.num_speculative_tokens: 5 is the node budget of the tree .* only 4 nodes"),
])
def test_bad_tree_values_are_refused(tree: object, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(EXAMPLE), speculator="medusa", speculator_model=HEADS, num_speculative_tokens=k,
            speculator_options={"tree": tree})


# --- draft vocabulary (the heads' draft_vocab; options.draft_vocab) -------------------------------------------------

def test_heads_draft_only_from_their_draft_vocabulary(plain_outputs: list[list[int]]) -> None:
    for options in ({}, {"tree": TREE}):
        llm = medusa(**({"num_speculative_tokens": 15} if options else {}), speculator_options=options)
        spec = llm.engine.speculator
        vocab = set(spec.draft_vocab.tolist())
        assert spec.head_weight.shape == (len(vocab), 256) and len(vocab) < 4096  # the LM head's rows, copied once
        outputs, proposals = drafts_of(llm, PROMPTS)
        drafted = [t for tokens in proposals for t in tokens]
        assert outputs == plain_outputs
        assert drafted and set(drafted) <= vocab
        assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_draft_vocab_false_scores_the_whole_vocabulary(plain_outputs: list[list[int]]) -> None:
    llm = medusa(speculator_options={"draft_vocab": False})
    assert llm.engine.speculator.head_weight is None and llm.engine.speculator.draft_vocab is None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [out.token_ids for out in llm.generate(PROMPTS, params)] == plain_outputs
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_bad_draft_vocab_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"speculator\.options\.draft_vocab must be true or false"):
        medusa(speculator_options={"draft_vocab": "yes"})
    from safetensors.torch import load_file, save_file

    package = copy_heads(tmp_path)
    weights, config_path = package / HEADS / "medusa.safetensors", package / HEADS / "config.json"
    state = load_file(str(weights))
    config = json.loads(config_path.read_text())
    vocab = state.pop("draft_vocab")
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"disagree on a draft vocabulary"):
        LLM(str(package), speculator="medusa", speculator_model=HEADS, num_speculative_tokens=2)
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k != "draft_vocab_size"}))
    with pytest.raises(ValueError, match=r"speculator\.options\.draft_vocab: the heads .* whole vocabulary"):
        LLM(str(package), speculator="medusa", speculator_model=HEADS, num_speculative_tokens=2,
            speculator_options={"draft_vocab": True})
    save_file({**state, "draft_vocab": vocab.flip(0)[:10]}, str(weights))
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"draft_vocab must hold \d+ distinct token ids"):
        LLM(str(package), speculator="medusa", speculator_model=HEADS, num_speculative_tokens=2)


# --- the native CPU linears (options.native_draft, native_draft_weights) ------------------------------------------

def drafts_of(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy outputs and every proposal's tokens, as the engine drafted them."""
    spec = llm.engine.speculator
    drafted: list[list[int]] = []
    propose = spec.propose

    def recording(inputs):  # type: ignore[no-untyped-def]
        out = propose(inputs)
        drafted.extend(p.token_ids for p in out if p is not None)
        return out

    spec.propose = recording
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)], drafted


@pytest.mark.parametrize("weights", ["int8", "float32"])
def test_the_native_linears_draft_what_the_torch_heads_draft(plain_outputs: list[list[int]], weights: str) -> None:
    from ember_kernels.cpu.draft_weights import packed_int8_available

    if not packed_int8_available():
        pytest.skip("native CPU kernels unavailable")
    native = medusa(speculator_options={"native_draft": True, "native_draft_weights": weights})
    assert native.engine.speculator.native is not None and native.engine.speculator.native.weight_format == weights
    calls = []
    heads = native.engine.speculator.native.head_states
    native.engine.speculator.native.head_states = lambda *a: calls.append(a) or heads(*a)
    outputs, drafted = drafts_of(native, PROMPTS)
    assert outputs == plain_outputs and calls  # exact, and the heads ran through the native linears
    torch_path = medusa(speculator_options={"native_draft": False})
    assert torch_path.engine.speculator.native is None
    outputs, reference = drafts_of(torch_path, PROMPTS)
    assert outputs == plain_outputs
    # The same heads: the same drafts but for near-ties (int8 rounds weights and, on VNNI CPUs, activations).
    same = sum(a == b for a, b in zip(drafted, reference, strict=False))
    assert len(drafted) == len(reference) and same >= (0.99 if weights == "float32" else 0.9) * len(reference)


def test_native_draft_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft must be true or false, got 'yes'"):
        medusa(speculator_options={"native_draft": "yes"})
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft_weights must be one of int8, float32"):
        medusa(speculator_options={"native_draft_weights": "int4"})
    with pytest.raises(ValueError, match=r"native_draft_weights is for the native kernel"):
        medusa(speculator_options={"native_draft": False, "native_draft_weights": "int8"})
