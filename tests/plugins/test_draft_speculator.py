"""`draft`: the distilled draft model of the example (examples/train_draft.py) drafts ahead of the target. Greedy output
is exactly the target's (alone, in a batch of 32, under preemption), drafts are accepted, the draft's own KV cache is
really read (its proposals are what the draft model, run from scratch by transformers over the whole sequence,
would greedily continue with), and a missing or mismatched draft directory is refused naming the setting, at load
and by `ember build`. That sampled output keeps the target's distribution is the chi-square test every speculator
runs (tests/plugins/test_speculator_distribution.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.engine import LLMEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
DRAFT = "speculator/draft"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n    path = os.path.",
           "class Stack:\n    def __init__(self):", "for i in range(10):\n    print(i)\nfor j in range(10):\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def draft(**overrides: object) -> LLM:
    return LLM(str(EXAMPLE), speculator="draft", speculator_model=DRAFT,
               **{"num_speculative_tokens": 3, "speculator_adaptive": False, **overrides})


@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    return [out.token_ids for out in LLM(str(EXAMPLE)).generate(PROMPTS, GREEDY)]


def test_greedy_output_is_the_targets_alone_and_in_a_batch_of_32(plain_outputs: list[list[int]]) -> None:
    llm = draft(speculator_max_batch_size=32, max_num_seqs=32)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain_outputs  # batch 1
    stats = llm.engine.stats()
    # The draft was distilled from the target (about half its greedy choices agree on held-out code).
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] > 0.2
    assert stats["spec_mean_accepted_length"] > 1.5
    # 32 requests in one batch (8 of each prompt), every one drafted for and verified each step.
    outputs = llm.generate(PROMPTS * 8, GREEDY)
    assert [out.token_ids for out in outputs] == plain_outputs * 8


def test_greedy_output_survives_preemption(plain_outputs: list[list[int]],
                                           run_preempted: Callable[..., list[list[int]]]) -> None:
    # 9 blocks of 16 tokens cannot hold 4 requests of up to ~60 tokens each: the newest are preempted and recomputed
    # (the draft's cache with them: it is rewritten from the recomputed prompt).
    engine = LLMEngine(EXAMPLE, speculator="draft", speculator_model=DRAFT, num_speculative_tokens=3,
                       speculator_adaptive=False, num_kv_blocks=9)
    assert run_preempted(engine, PROMPTS, GREEDY) == plain_outputs
    assert engine.num_accepted_tokens > 0


def hf_greedy_mismatches(seen: list[tuple[list[int], list[int]]], tolerance: float) -> list[tuple[int, float]]:
    """Against transformers' copy of the draft model given each whole sequence at once: for each proposal whose
    greedy continuation differs, (its index, how far below the top logit the proposed token's was)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(EXAMPLE / DRAFT, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for index, (tokens, proposal) in enumerate(seen):
            ids = torch.tensor([tokens])
            for token in proposal:
                logits = hf(ids).logits[0, -1]
                gap = float(logits.max() - logits[token])
                if int(logits.argmax()) != token and gap >= tolerance:
                    out.append((index, gap))
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def recorded(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """The engine's calls to propose, observed: (each drafted request's tokens, its proposal)."""
    spec = llm.engine.speculator
    seen: list[tuple[list[int], list[int]]] = []
    propose = spec.propose

    def recording(inputs):
        proposals = propose(inputs)
        for req, proposal in zip(inputs.requests, proposals, strict=True):
            if proposal is not None:
                seen.append((list(req.all_token_ids), list(proposal.token_ids)))
        return proposals

    spec.propose = recording
    return seen


# Prompts that arrive in chunks of at most 24 tokens; while all three run, more than speculator_max_batch_size, no
# drafts (and no draft pass): the cache catches up over what it missed when drafting resumes.
CHUNKED = {"max_num_batched_tokens": 24, "max_num_seqs": 4, "speculator_max_batch_size": 2}
CHUNKED_PROMPTS = [PROMPTS[0] * 3, PROMPTS[1], PROMPTS[3] * 2]  # a long prompt (several chunks) among short ones


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_the_native_kernel_drafts_the_draft_models_greedy_continuation(weights: str) -> None:
    """Greedy requests draft through draft_llama.c, one call per request and step (its catch-up over prompt chunks,
    verified tokens and overwritten drafts, then the chain): what it proposes is the draft model's own greedy
    continuation, but for near-ties; in bfloat16 or int8 (the default) the matrices round, so a few more differ."""
    llm = draft(**CHUNKED, speculator_options={"native_draft_weights": weights})
    spec = llm.engine.speculator
    assert spec.native is not None
    calls: list[tuple[int, int]] = []
    kernel = spec.native.draft
    spec.native.draft = lambda ids, first, *rest: calls.append((len(ids), first)) or kernel(ids, first, *rest)
    seen = recorded(llm)
    spec.chain.forward = None  # never called: every request is greedy
    lengths = [8, 30, 30]
    outputs = llm.generate(CHUNKED_PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                             for n in lengths])
    assert [len(o.token_ids) for o in outputs] == lengths
    assert len(seen) > 10 and len(calls) == len(seen)
    assert any(n > 24 for n, first in calls if first == 0)  # a whole prompt's catch-up in one call
    assert any(1 < n <= 4 and first > 0 for n, first in calls)  # verified tokens since the request's last step
    misses = hf_greedy_mismatches(seen, tolerance=1e-3)
    assert len(misses) <= {"float32": 0, "bfloat16": len(seen) // 10, "int8": len(seen) // 10}[weights], misses


def test_the_chain_decoder_drafts_the_draft_models_greedy_continuation() -> None:
    """The torch path (native_draft = false, and sampled requests always): the draft reads its paged KV cache
    through the chain decoder and the model code; what it proposes is the draft model's greedy continuation."""
    llm = draft(**CHUNKED, speculator_options={"native_draft": False})
    spec = llm.engine.speculator
    assert spec.native is None
    seen = recorded(llm)
    # The drafting passes run on the chain decoder (draft_chain.py), the first passes over a few new tokens too,
    # for one request and for two with runs of different lengths; the passes over whole prompts on the model code.
    assert spec.chain is not None
    chain_passes: list[tuple[int, int]] = []
    chain_forward = spec.chain.forward

    def counting(ids, positions, *args, **kwargs):
        chain_passes.append(tuple(ids.shape))
        return chain_forward(ids, positions, *args, **kwargs)

    spec.chain.forward = counting
    lengths = [8, 30, 30]
    outputs = llm.generate(CHUNKED_PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                             for n in lengths])
    assert [len(o.token_ids) for o in outputs] == lengths
    assert len(seen) > 10
    assert min(len(tokens) for tokens, _ in seen) >= len(llm.engine.tokenizer.encode(CHUNKED_PROMPTS[1])) + 8
    # Alone: the chain decoder keeps its buffer from step to step (nothing gathered from the paged cache).
    alone = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert len(alone[0].token_ids) == 30
    assert hf_greedy_mismatches(seen, tolerance=1e-3) == []  # only a near-tie may go the other way in float32
    assert {(1, 1), (2, 1)} <= set(chain_passes)  # one-token passes, alone and batched
    assert any(q > 1 for b, q in chain_passes if b == 2)  # a batched first pass over several new tokens


def test_a_batch_of_greedy_and_sampled_requests_drafts_on_both_paths(plain_outputs: list[list[int]]) -> None:
    # Greedy requests on the kernel, sampled ones on the model code, in the same steps; greedy output unchanged.
    llm = draft(max_num_seqs=8)
    spec = llm.engine.speculator
    kernel_calls, model_passes = [], []
    kernel, forward = spec.native.draft, spec._forward
    spec.native.draft = lambda *args: kernel_calls.append(1) or kernel(*args)
    spec._forward = lambda *args: model_passes.append(1) or forward(*args)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS + PROMPTS, [GREEDY] * len(PROMPTS) + [sampled] * len(PROMPTS))
    assert [out.token_ids for out in outputs[:len(PROMPTS)]] == plain_outputs
    assert all(len(out.token_ids) == 40 for out in outputs[len(PROMPTS):])
    assert len(kernel_calls) > 20 and len(model_passes) > 20


def test_native_draft_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft must be true or false, got 'yes'"):
        draft(speculator_options={"native_draft": "yes"})
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft is true, but it runs on CPU in float32"):
        draft(dtype="bfloat16", speculator_options={"native_draft": True})
    assert draft(dtype="bfloat16").engine.speculator.native is None  # by default: the torch paths where it cannot
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft_weights must be one of int8, bfloat16, "
                                         r"float32, got 'int4'"):
        draft(speculator_options={"native_draft_weights": "int4"})
    with pytest.raises(ValueError, match=r"native_draft_weights is for the native kernel, which .*native_draft = "
                                         r"false turns off"):
        draft(speculator_options={"native_draft": False, "native_draft_weights": "int8"})


def copy_package(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, package, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def test_missing_or_mismatched_draft_models_are_refused(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    root = package / DRAFT

    def load(model: str | None = DRAFT) -> LLM:
        return LLM(str(package), speculator="draft", num_speculative_tokens=2,
                   **({"speculator_model": model} if model is not None else {}))

    with pytest.raises(ValueError, match=r"speculator\.model: draft needs the directory of its draft model"):
        load(None)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "vocab_size": 8192}))
    with pytest.raises(ValueError, match=r"speculator\.model: .*config\.json: vocab_size is 8192, the target's is "
                                         r"4096"):
        load()
    config_path.write_text(json.dumps({**config, "eos_token_id": 3}))
    with pytest.raises(ValueError, match=r"speculator\.model: .*eos_token_id is 3, the target's is 1"):
        load()
    config_path.write_text("{not json")
    with pytest.raises(ValueError, match=r"speculator\.model: cannot read the draft model config .*config\.json"):
        load()
    config_path.write_text(json.dumps(config))
    tokenizer_path = root / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swapped: same size, different tokenizer
    tokenizer_path.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"speculator\.model: .*tokenizer\.json is not the target's tokenizer"):
        load()
    tokenizer_path.unlink()  # no tokenizer of its own: the config's vocabulary and special tokens decide
    (root / "model.safetensors").write_bytes(b"\0" * 64)  # corrupt weights
    with pytest.raises(ValueError, match=r"speculator\.model: cannot load the draft model in"):
        load()
    shutil.rmtree(root)  # the manifest refuses a path that is not there (ManifestError)
    with pytest.raises(Exception, match=r"speculator\.model: speculator model 'speculator/draft' does not exist"):
        load()


def test_ember_build_accepts_the_draft_and_refuses_one_of_another_tokenizer(tmp_path: Path) -> None:
    from ember.errors import PackageError
    from ember.package import build_package

    package = copy_package(tmp_path)
    (package / "ember.toml").write_text((package / "ember.toml").read_text()
                                        + '\n[speculator]\nmethod = "draft"\nmodel = "speculator/draft"\n')
    build_package(package)  # the example's own draft
    config_path = package / DRAFT / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "vocab_size": 8192}))
    with pytest.raises(PackageError, match=r"speculator\.model: .*vocab_size is 8192, the target's is 4096"):
        build_package(package)
    config_path.write_text(json.dumps(config))
    tokenizer_path = package / DRAFT / "tokenizer.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    tokenizer["added_tokens"] = tokenizer["added_tokens"][:-1]  # one special token fewer
    tokenizer_path.write_text(json.dumps(tokenizer))
    with pytest.raises(PackageError, match=r"speculator\.model: .*tokenizer\.json is not the target's tokenizer"):
        build_package(package)
