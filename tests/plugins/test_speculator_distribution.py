"""Every speculator keeps the target's sampling distribution exactly through the real engine (chi-square over
seeded samples, tests/platform/engine/spec_distribution.py), with and without top-k / top-p; and greedy and sampled
requests mixed in one batch each get what they would alone.

A new speculator joins by adding its engine overrides to SPECULATORS."""

from __future__ import annotations

from types import ModuleType

import pytest

from ember_platform import LLM, SamplingParams

SPECULATORS: dict[str, dict[str, object]] = {
    # min_ngram 1: the prompt's " self" is followed by ".get", so most requests get drafts, about 2/3 accepted
    "ngram": {"num_speculative_tokens": 3, "speculator_options": {"min_ngram": 1}},
    "medusa": {"num_speculative_tokens": 3, "speculator_model": "speculator/medusa"},
    # Tree verification: the 2nd step's tree is cut to the depth max_tokens leaves (length 3: the root's 3
    # candidates, siblings; length 4: 3 + 6 nodes), so multi-candidate rejection is what is tested.
    "medusa-tree": {"speculator": "medusa", "num_speculative_tokens": 15, "speculator_model": "speculator/medusa",
                    "speculator_options": {"tree": [3, 2, 1]}},
    # Sampled drafts from the head's own top-k / top-p distribution, returned as Proposal.probs.
    "eagle3": {"num_speculative_tokens": 3, "speculator_model": "speculator/eagle3"},
    "draft": {"num_speculative_tokens": 3, "speculator_model": "speculator/draft"},  # drafts drawn from its own probs
}
# Drafts from " self" on: ngram proposes what followed it earlier (".get_value()"), Medusa its heads' guesses.
PROMPT = "class Point:\n    def get(self):\n        return self.get_value()\n\n    def __repr__(self):\n        return"
PARAMS = {"temperature": SamplingParams(temperature=0.7),
          "top_k_top_p": SamplingParams(temperature=0.8, top_k=20, top_p=0.9)}
ALPHA = 1e-3  # the draws are seeded, so each test is deterministic; this is how unlucky a correct one may be


@pytest.fixture(scope="module", params=list(SPECULATORS))
def speculative(request: pytest.FixtureRequest, spec_distribution: ModuleType) -> tuple[str, LLM]:
    overrides = dict(SPECULATORS[request.param])
    method = str(overrides.pop("speculator", request.param))  # a variant of a speculator names the one it runs
    return request.param, spec_distribution.speculative_llm(method, **overrides)


@pytest.mark.slow
@pytest.mark.parametrize("params", list(PARAMS))
def test_sampled_tokens_follow_the_targets_distribution(speculative: tuple[str, LLM], params: str,
                                                        spec_distribution: ModuleType) -> None:
    name, llm = speculative
    # 3 tokens: the second step verifies one draft (kept, or a residual draw), then a bonus token.
    fit = spec_distribution.check_distribution(llm, PROMPT, PARAMS[params], length=3, num_samples=3000,
                                               min_expected=10)
    assert fit.num_drafts >= 2000, f"{name}: speculation hardly acted ({fit})"
    assert fit.dof >= 15, fit
    assert fit.p_value > ALPHA, f"{name} changes the distribution: {fit}"


@pytest.mark.slow
def test_two_drafts_follow_the_targets_distribution(speculative: tuple[str, LLM],
                                                    spec_distribution: ModuleType) -> None:
    name, llm = speculative
    # 4 tokens: two drafts verified on the second step (a second draft is judged only when the first was kept).
    fit = spec_distribution.check_distribution(llm, PROMPT, PARAMS["top_k_top_p"], length=4, num_samples=3000,
                                               min_expected=10, seed=10_000)
    assert fit.num_drafts >= 5000, f"{name}: speculation hardly acted ({fit})"
    assert fit.p_value > ALPHA, f"{name} changes the distribution: {fit}"


PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n    path = os.path.",
           "class Stack:\n    def __init__(self):", "for i in range(10):\n    print(i)\nfor j in range(10):\n"]


def test_greedy_and_sampled_requests_in_one_batch_get_what_they_would_alone(speculative: tuple[str, LLM]) -> None:
    name, llm = speculative
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
               SamplingParams(temperature=1.0, top_k=30, top_p=0.95, seed=12, max_tokens=24, ignore_eos=True)]
    plain = LLM(str(llm.engine.source.root))
    expected_greedy = [plain.generate([p], greedy)[0].token_ids for p in PROMPTS]
    alone = [llm.generate([PROMPTS[1]], sampled[0])[0].token_ids, llm.generate([PROMPTS[3]], sampled[1])[0].token_ids]
    drafts = llm.engine.num_draft_tokens
    mixed = llm.generate([*PROMPTS, PROMPTS[1], PROMPTS[3]], [greedy] * 4 + sampled)
    assert llm.engine.num_draft_tokens > drafts, f"{name} proposed no drafts in the mixed batch"
    assert [out.token_ids for out in mixed[:4]] == expected_greedy  # greedy: exactly no speculation's
    assert [out.token_ids for out in mixed[4:]] == alone  # sampled and seeded: as alone
    # and seeded sampling with speculation is reproducible run to run
    assert [out.token_ids for out in llm.generate([PROMPTS[3], PROMPTS[1]], sampled[::-1])] == alone[::-1]
