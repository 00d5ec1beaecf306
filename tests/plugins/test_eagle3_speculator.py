"""`eagle3`: the trained head on the example model drafts from the target's low/middle/high hidden states through its
own paged KV cache; greedy output is exactly the target's (alone, in a batch of 32, under preemption), the drafts
are really accepted and are what the head computes from the target's hidden states outside the engine, sampled
requests mix with greedy ones, and bad head directories are refused with the setting named. That sampled output keeps
the target's distribution is tests/plugins/test_speculator_distribution.py's chi-square (eagle3 is one of its
speculators)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from ember_platform import LLM, SamplingParams
from ember_platform.engine.engine import LLMEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
HEAD = "speculator/eagle3"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n    path = os.path.",
           "class Stack:\n    def __init__(self):", "for i in range(10):\n    print(i)\nfor j in range(10):\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def eagle3(**overrides: object) -> LLM:
    return LLM(str(EXAMPLE), speculator="eagle3", speculator_model=HEAD,
               **{"num_speculative_tokens": 3, "speculator_adaptive": False, **overrides})


@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    return [out.token_ids for out in LLM(str(EXAMPLE)).generate(PROMPTS, GREEDY)]


def test_greedy_output_is_the_targets_and_drafts_are_accepted(plain_outputs: list[list[int]]) -> None:
    llm = eagle3()
    assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain_outputs  # batch 1
    stats = llm.engine.stats()
    # The head was trained (examples/train_eagle3.py; its training.json has the held-out figures: about 88% of
    # first drafts right on the target's own continuations): many drafts are accepted.
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] > 0.3, stats
    assert stats["spec_mean_accepted_length"] > 1.8, stats


def test_greedy_output_in_a_batch_of_32(plain_outputs: list[list[int]]) -> None:
    llm = eagle3(max_num_seqs=32, speculator_max_batch_size=32)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    outputs = llm.generate(prompts, GREEDY)
    assert [out.token_ids for out in outputs] == [plain_outputs[i % len(PROMPTS)] for i in range(32)]
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_greedy_output_survives_preemption(plain_outputs: list[list[int]],
                                           run_preempted: Callable[..., list[list[int]]]) -> None:
    # 9 blocks of 16 tokens cannot hold 4 requests of up to ~60 tokens each: the newest are preempted and recomputed.
    engine = LLMEngine(EXAMPLE, speculator="eagle3", speculator_model=HEAD, num_speculative_tokens=3,
                       speculator_adaptive=False, num_kv_blocks=9)
    assert run_preempted(engine, PROMPTS, GREEDY) == plain_outputs
    assert engine.num_accepted_tokens > 0


TREE = {"tree_top_k": 3, "tree_depth": 4}


def test_dynamic_tree_output_is_the_targets_and_accepts_more_than_the_chain(plain_outputs: list[list[int]]) -> None:
    chain = eagle3(num_speculative_tokens=4)
    tree = eagle3(num_speculative_tokens=8, speculator_options=TREE)
    assert [chain.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain_outputs
    assert [tree.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain_outputs  # batch 1
    assert [out.token_ids for out in tree.generate(PROMPTS, GREEDY)] == plain_outputs  # one batch
    chain_length = chain.engine.stats()["spec_mean_accepted_length"]
    tree_length = tree.engine.stats()["spec_mean_accepted_length"]
    assert tree_length > chain_length, (tree_length, chain_length)
    # Sampled requests beside greedy ones draft chains (trees are verified for deterministic drafts only).
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    outputs = tree.generate(PROMPTS, [GREEDY, sampled, GREEDY, sampled])
    assert outputs[0].token_ids == plain_outputs[0] and outputs[2].token_ids == plain_outputs[2]


def test_dynamic_tree_survives_preemption(plain_outputs: list[list[int]],
                                          run_preempted: Callable[..., list[list[int]]]) -> None:
    engine = LLMEngine(EXAMPLE, speculator="eagle3", speculator_model=HEAD, num_speculative_tokens=6,
                       speculator_adaptive=False, speculator_options=TREE, num_kv_blocks=9)
    assert run_preempted(engine, PROMPTS, GREEDY) == plain_outputs


def test_drafting_resumes_after_steps_with_nothing_to_propose_for(plain_outputs: list[list[int]]) -> None:
    # Above speculator.max_batch_size the head skips its pass (nothing to draft for); once requests finish and the
    # batch is small again, it drafts around the positions it skipped, and the output is still the target's.
    llm = eagle3(speculator_max_batch_size=1)
    prompts = PROMPTS[:2]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    outputs = llm.generate(prompts, params)
    assert outputs[0].token_ids == plain_outputs[0]
    assert outputs[1].token_ids == plain_outputs[1][:20]
    speculator = llm.engine.speculator
    assert llm.engine.num_accepted_tokens > 0
    assert not speculator._gaps  # released with the requests


def test_skipped_steps_leave_one_gap_that_ends_where_drafting_resumes() -> None:
    # Steps with nothing to propose for cost a dict lookup per request (no pass of the head, no per-step record);
    # the positions they skipped become one gap, closed at the first position the head writes again.
    llm = eagle3(speculator_max_batch_size=1)
    engine, speculator = llm.engine, llm.engine.speculator
    engine.add_request("long", PROMPTS[0], GREEDY)
    engine.add_request("short", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    prompt_len = len(engine.tokenizer.encode(PROMPTS[0]))
    closed_at = []
    close = speculator._close
    speculator._close = lambda rid, first: (closed_at.append((rid, first)), close(rid, first))
    while engine.has_unfinished() and not closed_at:
        engine.step()
        if not closed_at:
            assert speculator._open["long"][0] == 0 and not speculator._gaps  # skipping since its prompt
    rid, first = closed_at[0]
    assert rid == "long" and first > prompt_len  # "short" finished: "long" drafts alone, past its prompt
    assert speculator._gaps == {"long": [(0, first)]} and "long" not in speculator._open
    while engine.has_unfinished():
        engine.step()
    engine.forget("long")
    engine.forget("short")
    assert not speculator._gaps and not speculator._open


def test_drafts_for_a_few_of_the_batch_catch_up_only_those(plain_outputs: list[list[int]]) -> None:
    # The length chooser's probe in a batch where drafts do not pay gives drafts to a few requests only: the head
    # then writes the rows of those alone (the others' rows become gaps, as in a step without drafts), not a pass
    # over the whole batch, prompt chunks included. Output stays the target's and the drafts are accepted.
    llm = eagle3()
    engine, speculator = llm.engine, llm.engine.speculator
    draft_lengths = engine.spec.draft_lengths

    def first_only(batch: list, num_running: int) -> dict[int, int] | None:
        budgets = draft_lengths(batch, num_running)
        return None if budgets is None else {i: k for i, k in budgets.items() if batch[i].request_id == "0"}

    engine.spec.draft_lengths = first_only
    written: list[set[str]] = []
    for method in ("_native_step", "_catch_up"):
        inner = getattr(speculator, method)

        def recording(inputs: Any, kept: list, *args: Any, inner: Callable = inner) -> Any:
            written.append({inputs.batch[e.index].request_id for e in kept})
            return inner(inputs, kept, *args)

        setattr(speculator, method, recording)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if 0 < len(outputs["0"]) < GREEDY.max_tokens:  # "0" drafting, the others skipping (the first to finish)
            assert {"1", "2", "3"} <= set(speculator._open)
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == plain_outputs
    assert written and all(ids == {"0"} for ids in written), written
    assert engine.num_accepted_tokens > 0


def reference_drafts(draft: torch.nn.Module, hf_model: torch.nn.Module, layers: tuple[int, ...], tokens: list[int],
                     k: int) -> list[int]:
    """The head's k greedy drafts after `tokens`, computed from transformers' hidden states with dense attention:
    every position catches up (the token after it, its fused features), then the chain."""
    from ember_plugins.speculators.eagle3_model import rope_cos_sin

    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = hf_model(input_ids=ids[:, :-1], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)  # [P, 3D], positions 0..P-1
        p, hd = aux.shape[0], draft.head_dim
        hidden = draft.fuse(aux)
        embed = hf_model.model.embed_tokens
        vocab = draft.draft_vocab
        head = hf_model.lm_head.weight[vocab]
        cos, sin = rope_cos_sin(torch.arange(p), hd, 10_000.0, torch.float32)
        q, keys, values = draft.qkv(embed(ids[0, 1:]), hidden, cos, sin)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                              values.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        h = draft.finish(attn[0].transpose(0, 1).reshape(p, -1), hidden)[-1:]
        drafts = [int(vocab[F.linear(draft.logits_input(h), head).argmax()])]
        for j in range(1, k):
            cos, sin = rope_cos_sin(torch.tensor([p - 1 + j]), hd, 10_000.0, torch.float32)
            qj, kj, vj = draft.qkv(embed(torch.tensor(drafts[-1:])), h, cos, sin)
            keys, values = torch.cat([keys, kj]), torch.cat([values, vj])
            o = F.scaled_dot_product_attention(qj.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                               values.transpose(0, 1)[None], enable_gqa=True)
            h = draft.finish(o[0].transpose(0, 1).reshape(1, -1), h)
            drafts.append(int(vocab[F.linear(draft.logits_input(h), head).argmax()]))
    return drafts


@pytest.mark.parametrize("options", [{}, {"native_draft_weights": "bfloat16"}, {"native_draft": False}],
                         ids=["native-kernel-int8", "native-kernel-bf16", "torch"])
def test_the_engine_drafts_what_the_head_computes_from_the_targets_hidden_states(options: dict) -> None:
    # Both drafting paths: the native kernel (eagle3_draft.c, one call per request and step; its matrices in int8 by
    # default, or bfloat16) and the torch ops.
    from transformers import LlamaForCausalLM

    native = options.get("native_draft", True)
    llm = eagle3(enable_prefix_caching=False, speculator_options=options)
    speculator = llm.engine.speculator
    assert (speculator.native is not None) is native
    seen: list[tuple[list[int], list[int]]] = []
    propose = speculator.propose
    kernel_calls = []
    if native:
        kernel = speculator.native.draft
        speculator.native.draft = lambda *args: kernel_calls.append(args[10]) or kernel(*args)

    def recording(inputs):  # the engine's call, observed
        proposals = propose(inputs)
        for req, proposal in zip(inputs.requests, proposals, strict=True):
            if proposal is not None and len(proposal.token_ids) == 3:
                seen.append((list(req.all_token_ids), list(proposal.token_ids)))
        return proposals

    speculator.propose = recording
    llm.generate(PROMPTS[:2], GREEDY)
    hf_model = LlamaForCausalLM.from_pretrained(EXAMPLE / "weights", dtype=torch.float32).eval()
    assert len(seen) > 10
    checked = seen[::max(1, len(seen) // 12)]
    same = [reference_drafts(speculator.draft.float(), hf_model, speculator.aux_layers(), tokens, 3) == drafts
            for tokens, drafts in checked]
    assert sum(same) >= len(same) - 1, same  # float32 differences may flip one near-tie argmax, not more
    if native:  # the engine's drafts came from the kernel: one call per request and step, chains of 3
        assert kernel_calls.count(3) >= len(seen), (len(kernel_calls), len(seen))


def test_native_draft_option_is_checked() -> None:
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft must be true or false, got 'yes'"):
        eagle3(speculator_options={"native_draft": "yes"})
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft is true, but it runs on CPU in float32"):
        eagle3(dtype="bfloat16", speculator_options={"native_draft": True})
    assert eagle3(dtype="bfloat16").engine.speculator.native is None  # by default: the torch path where it cannot
    with pytest.raises(ValueError, match=r"speculator\.options\.native_draft_weights must be one of bfloat16, int8, "
                                         r"float32, got 'int4'"):
        eagle3(speculator_options={"native_draft_weights": "int4"})
    with pytest.raises(ValueError, match=r"native_draft_weights is for the native kernel, which .*native_draft = "
                                         r"false turns off"):
        eagle3(speculator_options={"native_draft": False, "native_draft_weights": "int8"})


def test_sampled_requests_mix_with_greedy_ones_in_a_batch(plain_outputs: list[list[int]]) -> None:
    llm = eagle3()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [GREEDY, sampled, GREEDY, sampled])
    assert outputs[0].token_ids == plain_outputs[0] and outputs[2].token_ids == plain_outputs[2]
    assert all(len(out.token_ids) == 40 for out in outputs)
    again = eagle3().generate(PROMPTS, [GREEDY, sampled, GREEDY, sampled])
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # seeded: reproducible


def copy_package(tmp_path: Path) -> Path:
    package = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, package, ignore=shutil.ignore_patterns("__pycache__"))
    return package


def test_heads_for_another_model_or_broken_ones_are_refused(tmp_path: Path) -> None:
    package = copy_package(tmp_path)
    config_path = package / HEAD / "config.json"
    config = json.loads(config_path.read_text())

    def build() -> LLM:
        return LLM(str(package), speculator="eagle3", speculator_model=HEAD, num_speculative_tokens=2)

    with pytest.raises(ValueError, match=r"speculator\.model: eagle3 needs the directory of its EAGLE-3 head"):
        LLM(str(package), speculator="eagle3", num_speculative_tokens=2)
    for key, value, message in (("hidden_size", 512, "trained for hidden_size 512, the model has 256"),
                                ("vocab_size", 32000, "trained for vocab_size 32000, the model has 4096"),
                                ("num_target_layers", 32, "trained for num_target_layers 32, the model has 4"),
                                ("aux_layers", [1, 2, 9], r"aux_layers must be three layer indices in 0\.\.3"),
                                ("architecture", "medusa", "does not describe an EAGLE-3 head")):
        config_path.write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=f"speculator\\.model: .*{message}") as info:
            build()
        assert "config.json" in str(info.value) or key != "architecture"
    config_path.write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(ValueError, match=r"speculator\.model: .*eagle3\.safetensors does not match its config"):
        build()
    config_path.write_text(json.dumps(config))
    (package / HEAD / "eagle3.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"speculator\.model: cannot read the EAGLE-3 head's weights"):
        build()
    config_path.unlink()
    with pytest.raises(ValueError, match=r"speculator\.model: cannot read the EAGLE-3 head config .*config\.json"):
        build()
    shutil.rmtree(package / HEAD)
    with pytest.raises(Exception, match=r"speculator\.model: speculator model 'speculator/eagle3' does not exist"):
        build()
    with pytest.raises(Exception, match=r"speculator\.options\.tree"):
        LLM(str(EXAMPLE), speculator="eagle3", speculator_model=HEAD, num_speculative_tokens=2,
            speculator_options={"tree": [4, 2]})
    for options, budget, message in (({"tree_top_k": 0}, 2, r"speculator\.options\.tree_top_k must be an integer"),
                                     ({"tree_top_k": 2, "tree_depth": 1}, 2, r"options\.tree_depth must be"),
                                     ({"tree_depth": 3}, 2, r"tree_depth needs speculator\.options\.tree_top_k"),
                                     ({"tree_top_k": 2, "tree_depth": 2}, 7,
                                      r"num_speculative_tokens: 7 is the tree's node budget.*only 6")):
        with pytest.raises(ValueError, match=message):
            LLM(str(EXAMPLE), speculator="eagle3", speculator_model=HEAD, num_speculative_tokens=budget,
                speculator_options=options)


def test_the_native_steps_rope_rows_are_the_computed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # The native step reads cos/sin as views of a table grown on demand; past the table's limit they are computed.
    from ember_plugins.speculators import eagle3 as module

    monkeypatch.setattr(module, "ROPE_TABLE_LIMIT", 600)
    speculator = eagle3().engine.speculator
    for first, count in [(0, 4), (250, 7), (255, 3), (590, 10), (700, 5)]:  # grows 256 -> 512 -> 600, then beyond
        cos, sin = speculator._rope_rows(first, count, torch.float32)
        want_cos, want_sin = speculator._rope(torch.arange(first, first + count), torch.float32)
        assert cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert speculator._rope_tables[torch.float32][0].shape[0] == 600
