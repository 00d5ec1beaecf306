"""Tree drafts through the engine, with a speculator that knows the greedy continuation and hides it on the second
branch of a tree (the first branch is always wrong): the accepted path is never the first nodes, so the engine must
compute each node at its depth with the tree mask, move the accepted path's KV to consecutive slots, and go on from
there; greedy output stays the target's (alone, batched, under preemption), sampled requests mix in the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ember_platform import SamplingParams
from ember_platform.api import Proposal, Speculator, SpeculatorInputs
from ember_platform.engine.engine import LLMEngine
from ember_platform.engine.spec_tree import ancestor_mask

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n    path = os.path.",
           "class Stack:\n    def __init__(self):", "for i in range(10):\n    print(i)\nfor j in range(10):\n"]
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
# root -> wrong (0), right (1); 0 -> wrong (2); 1 -> wrong (3), right (4); 4 -> right (5)
TREE = [-1, -1, 0, 1, 1, 4]


class SecondBranchOracle(Speculator):
    """Drafts TREE with the reference continuation on nodes 1, 4, 5 and wrong tokens elsewhere."""

    drafts_trees = True

    def __init__(self, reference: dict[str, list[int]], engine: LLMEngine) -> None:
        assert engine.speculator is not None
        super().__init__({}, engine.speculator.context)
        vocab = engine.vocab_size
        self.reference = reference
        self.vocab = vocab
        self.num_proposed = 0

    def propose(self, inputs: SpeculatorInputs) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for req in inputs.requests:
            ref = self.reference.get(req.request_id.split("#")[0], [])
            m = len(req.output_token_ids)
            truth = ref[m:m + 3]
            if len(truth) < 3:
                out.append(None)
                continue
            wrong = [(t + 1) % self.vocab for t in truth]
            self.num_proposed += 1
            out.append(Proposal([wrong[0], truth[0], wrong[0], wrong[1], truth[1], truth[2]], parents=list(TREE)))
        return out


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    engine = LLMEngine(EXAMPLE)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    return _run(engine)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def _oracle_engine(reference: dict[str, list[int]], **overrides: Any) -> tuple[LLMEngine, SecondBranchOracle]:
    engine = LLMEngine(EXAMPLE, speculator="ngram", num_speculative_tokens=len(TREE), speculator_adaptive=False,
                       **overrides)
    assert engine.spec is not None
    oracle = SecondBranchOracle(reference, engine)
    engine.spec.speculator = engine.speculator = oracle
    return engine, oracle


def test_second_branch_is_accepted_and_generation_continues_exactly(reference: dict[str, list[int]]) -> None:
    engine, oracle = _oracle_engine(reference)
    engine.add_request("0", PROMPTS[0], GREEDY)  # alone
    assert _run(engine)["0"] == reference["0"]
    assert oracle.num_proposed > 3
    # Every proposal had its continuation on nodes 1, 4, 5: three drafts accepted each time (no chance involved).
    assert engine.num_accepted_tokens == 3 * oracle.num_proposed
    assert engine.spec.length.mean_accepted_length == pytest.approx(4.0)

    engine, _ = _oracle_engine(reference)
    for i, prompt in enumerate(PROMPTS):  # batched
        engine.add_request(str(i), prompt, GREEDY)
    assert _run(engine) == reference


def test_tree_steps_survive_preemption(reference: dict[str, list[int]]) -> None:
    # 7 blocks of 16 tokens cannot hold 4 requests of ~45 tokens (plus 7 tree tokens each): some are preempted.
    engine, oracle = _oracle_engine(reference, num_kv_blocks=7)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    preempted = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        preempted = max(preempted, max((r.num_preemptions for r in engine.scheduler.running), default=0))
    assert preempted > 0 and oracle.num_proposed > 0
    assert tokens == reference


def test_sampled_tree_requests_mix_with_greedy_ones(reference: dict[str, list[int]]) -> None:
    engine, _ = _oracle_engine(reference)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY if i % 2 == 0 else sampled)
    out = _run(engine)
    assert out["0"] == reference["0"] and out["2"] == reference["2"]
    assert all(len(out[str(i)]) == 30 for i in (1, 3))


def test_the_tree_plan_computes_nodes_at_their_depth() -> None:
    from ember_platform.engine.request import Request
    from ember_platform.engine.step_plan import StepPlan

    req = Request("r", [5, 6, 7], GREEDY, 0)
    req.output_token_ids = [8]
    req.num_computed_tokens = 3
    req.block_ids = [0]
    req.spec_token_ids = [1, 2, 3, 4, 5, 6]
    req.spec_parents = list(TREE)
    plan = StepPlan.build([req], [7])
    assert plan.positions.tolist() == [3, 4, 5, 6, 7, 8, 9]  # KV slots in node order
    assert plan.rope_positions is not None and plan.rope_positions.tolist() == [3, 4, 4, 5, 5, 5, 6]
    assert plan.trees == [(0, TREE)]
    from ember_platform.engine.model_runner import plan_metadata

    meta = plan_metadata(plan, 16, plan.positions.device)
    assert meta.tree_masks[0].equal(ancestor_mask(TREE))
    req.spec_token_ids = req.spec_token_ids[:2]  # the scheduler cut the drafts: a prefix of a tree is a tree
    assert StepPlan.build([req], [3]).trees == [(0, [-1, -1])]
    req.spec_parents = [-1, 0, 1, 2, 3, 4]  # a chain: no tree logic at all
    assert StepPlan.build([req], [3]).rope_positions is None


def test_a_backend_without_tree_attention_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember_plugins.attention.torch_paged import TorchPagedAttention

    monkeypatch.setattr(TorchPagedAttention, "supports_tree_attention", False)
    with pytest.raises(ValueError, match="drafts trees, but attention backend 'torch' does not support tree"):
        LLMEngine(EXAMPLE, speculator="medusa", speculator_model="speculator/medusa", num_speculative_tokens=4,
                  speculator_options={"tree": [2, 2]})
