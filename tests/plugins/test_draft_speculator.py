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


def test_proposals_are_the_draft_models_own_greedy_continuation() -> None:
    """The draft reads its paged KV cache (filled over prompt chunks, verified tokens and overwritten drafts): what it
    proposes is what transformers' copy of the draft model, given the whole sequence at once, continues with."""
    from transformers import AutoModelForCausalLM

    # The prompts arrive in chunks of at most 24 tokens; while all three run, more than speculator_max_batch_size, no
    # drafts (and no draft pass): the cache catches up over what it missed when drafting resumes.
    llm = draft(max_num_batched_tokens=24, max_num_seqs=4, speculator_max_batch_size=2)
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
    # The drafting passes run on the chain decoder (draft_chain.py), the first passes over a few new tokens too,
    # for one request and for two with runs of different lengths; the passes over whole prompts on the model code.
    assert spec.chain is not None
    chain_passes: list[tuple[int, int]] = []
    chain_forward = spec.chain.forward

    def counting(ids, positions, *args, **kwargs):
        chain_passes.append(tuple(ids.shape))
        return chain_forward(ids, positions, *args, **kwargs)

    spec.chain.forward = counting
    prompts = [PROMPTS[0] * 3, PROMPTS[1], PROMPTS[3] * 2]  # a long prompt (several chunks) among short ones
    lengths = [8, 30, 30]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [len(o.token_ids) for o in outputs] == lengths
    assert len(seen) > 10 and min(len(tokens) for tokens, _ in seen) >= len(llm.engine.tokenizer.encode(prompts[1])) + 8
    # Alone: the chain decoder keeps its buffer from step to step (nothing gathered from the paged cache).
    alone = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert len(alone[0].token_ids) == 30
    hf = AutoModelForCausalLM.from_pretrained(EXAMPLE / DRAFT, dtype=torch.float32).eval()
    exact = 0
    with torch.no_grad():
        for tokens, proposal in seen:
            ids = torch.tensor([tokens])
            for j, token in enumerate(proposal):
                logits = hf(ids).logits[0, -1]
                if int(logits.argmax()) != token:  # only a near-tie may go the other way in float32
                    assert float(logits.max() - logits[token]) < 1e-3, (tokens, proposal, j)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            exact += 1
    assert exact == len(seen)
    assert {(1, 1), (2, 1)} <= set(chain_passes)  # one-token passes, alone and batched
    assert any(q > 1 for b, q in chain_passes if b == 2)  # a batched first pass over several new tokens


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
