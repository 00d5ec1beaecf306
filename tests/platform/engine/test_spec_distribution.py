"""The speculation distribution harness (spec_distribution.py) can fail: its p-value is the chi-square one, and wrong
verification rules run through the real engine (ngram drafts on the example model) are rejected at once."""

from __future__ import annotations

import math
from collections import Counter
from types import ModuleType

import pytest

from ember_platform import SamplingParams

PROMPT = "class Point:\n    def get(self):\n        return self.get_value()\n\n    def __repr__(self):\n        return"


def test_chi_square_p_values(spec_distribution: ModuleType) -> None:
    p = spec_distribution.chi_square_p_value
    assert math.isclose(p(3.841459, 1), 0.05, rel_tol=1e-5)  # the textbook 95% quantiles
    assert math.isclose(p(18.307038, 10), 0.05, rel_tol=1e-5)
    assert math.isclose(p(10.0, 10), 0.44049, rel_tol=1e-4)
    # Bins below the expected minimum are pooled: at 20, ("c",) and ("d",) pool into "other".
    probs = {("a",): 0.5, ("b",): 0.3, ("c",): 0.15, ("d",): 0.05}
    statistic, dof, counts, _ = spec_distribution.chi_square(Counter({("a",): 50, ("b",): 30, ("c",): 20}),
                                                                    probs, 100, min_expected=20)
    assert dof == 2 and counts == {("a",): 50, ("b",): 30, ("other",): 20} and statistic == pytest.approx(0.0)
    # An "other" bin too small to stand alone is merged into the smallest named one.
    _, dof, counts, _ = spec_distribution.chi_square(Counter({("a",): 50, ("b",): 30, ("c",): 20}), probs, 100,
                                                     min_expected=25)
    assert dof == 1 and counts == {("a",): 50, ("b",): 50}


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["accept_every_draft", "resample_from_target"])
def test_a_wrong_verification_rule_is_caught(rule: str, spec_distribution: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import ember_platform.engine.step_sampler as step_sampler

    llm = spec_distribution.speculative_llm("ngram", num_speculative_tokens=3, speculator_options={"min_ngram": 1})
    monkeypatch.setattr(step_sampler, "rejection_sample", getattr(spec_distribution, rule))
    fit = spec_distribution.check_distribution(llm, PROMPT, SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
                                               length=3, num_samples=3000, min_expected=10)
    assert fit.num_drafts >= 2000
    assert fit.p_value < 1e-20, fit  # the real rule passes: tests/plugins/test_speculator_distribution.py
