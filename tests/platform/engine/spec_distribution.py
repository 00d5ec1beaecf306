"""A statistical harness: does speculation keep the target's sampling distribution exactly, through the real engine?

For a fixed prompt, many seeded requests sample their first `length` tokens with speculation on (each request its
own seed, so the whole draw is deterministic); the exact probability of every token sequence comes from the target
alone: transformers' logits for the same checkpoint, processed by the engine's own `Sampler.probs` (temperature,
top-k, top-p: the distribution the engine samples from without speculation). A chi-square goodness-of-fit test
over the sequences with enough expected mass (the rest pooled in one bin) must not reject at a small alpha.

Speculation only acts from the second generated token on (the first comes from the prefill, before any drafts), so
`length` >= 2; with `max_tokens = length` the engine drafts at most `length - 2` tokens on the second step, so
length 3 verifies one draft (kept, or replaced by a residual draw, then a bonus token) and length 4 two.

Tests load this module with the `spec_distribution` fixture (tests/conftest.py): under `--import-mode=importlib`
the test tree is not on sys.path. No scipy in the venv: the p-value is torch's regularized upper incomplete gamma.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch

from ember_platform import LLM, SamplingParams
from ember_platform.engine.sampler import Sampler, SamplingBatch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
OTHER = ("other",)  # the bin of every sequence too unlikely to have a bin of its own


@dataclass(frozen=True, slots=True)
class FitResult:
    """A chi-square goodness-of-fit of sampled token sequences against their exact probabilities."""

    num_samples: int
    num_bins: int
    statistic: float
    dof: int
    p_value: float
    observed: dict[tuple, int]
    expected: dict[tuple, float]
    num_drafts: int  # draft tokens the engine verified while sampling (0: speculation never acted)
    num_accepted: int

    def worst(self, n: int = 5) -> list[tuple[tuple, int, float]]:
        """The bins that contribute most to the statistic: (sequence, observed, expected)."""
        keys = sorted(self.expected, key=lambda b: -(self.observed.get(b, 0) - self.expected[b]) ** 2
                      / self.expected[b])
        return [(b, self.observed.get(b, 0), round(self.expected[b], 1)) for b in keys[:n]]

    def __str__(self) -> str:
        return (f"chi2={self.statistic:.1f} dof={self.dof} p={self.p_value:.3g} n={self.num_samples} "
                f"drafts={self.num_drafts} accepted={self.num_accepted} worst={self.worst()}")


def chi_square_p_value(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): Q(dof / 2, statistic / 2)."""
    if dof < 1:
        raise ValueError("a chi-square test needs at least two bins")
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square(observed: Counter, probs: dict[tuple, float], num_samples: int,
               min_expected: float = 5.0) -> tuple[float, int, dict[tuple, int], dict[tuple, float]]:
    """The Pearson statistic over the sequences expected at least `min_expected` times; all others (sampled or
    not) pooled in the OTHER bin, which is merged into the smallest named bin when it is itself too small."""
    named = {seq: p * num_samples for seq, p in probs.items() if p * num_samples >= min_expected}
    expected = dict(named)
    expected[OTHER] = max(0.0, num_samples - sum(named.values()))
    counts = {b: 0 for b in expected}
    for seq, n in observed.items():
        counts[seq if seq in named else OTHER] += n
    if expected[OTHER] < min_expected:
        smallest = min(named, key=named.__getitem__)
        expected[smallest] += expected.pop(OTHER)
        counts[smallest] += counts.pop(OTHER)
    statistic = sum((counts[b] - e) ** 2 / e for b, e in expected.items())
    return statistic, len(expected) - 1, counts, expected


@cache
def _target(weights: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32).eval()


@torch.inference_mode()
def exact_probabilities(prompt_ids: Sequence[int], params: SamplingParams, length: int, min_prob: float,
                        package: Path = EXAMPLE) -> dict[tuple, float]:
    """P(first `length` tokens) under the target alone, for every sequence of at least `min_prob` (each of its
    prefixes has at least that probability too, so only those are expanded)."""
    model = _target(package / "weights")
    sampler = Sampler()
    plain = replace(params, seed=None)  # the distribution, not a draw: no generator needed
    frontier: dict[tuple, float] = {(): 1.0}
    for _ in range(length):
        prefixes = list(frontier)
        ids = torch.tensor([[*prompt_ids, *p] for p in prefixes], dtype=torch.long)  # equal lengths: no padding
        logits = model(input_ids=ids).logits[:, -1].float()
        batch = SamplingBatch.build([plain] * len(prefixes), vocab_size=logits.shape[-1])
        probs = sampler.probs(logits, batch).double()
        grown: dict[tuple, float] = {}
        for prefix, row in zip(prefixes, probs, strict=True):
            keep = (row * frontier[prefix] >= min_prob).nonzero().flatten().tolist()
            for t in keep:
                grown[(*prefix, t)] = frontier[prefix] * float(row[t])
        frontier = grown
    return frontier


def sample_sequences(llm: LLM, prompt_ids: Sequence[int], params: SamplingParams, length: int, num_samples: int,
                     seed: int) -> Counter:
    """The first `length` tokens of `num_samples` requests for one prompt, request i seeded `seed + i`."""
    each = [replace(params, max_tokens=length, ignore_eos=True, seed=seed + i) for i in range(num_samples)]
    outputs = llm.generate([list(prompt_ids)] * num_samples, each)
    sequences = Counter(tuple(out.token_ids) for out in outputs)
    if any(len(seq) != length for seq in sequences):
        raise AssertionError(f"expected {length} tokens per request, got lengths {sorted({len(s) for s in sequences})}")
    return sequences


def check_distribution(llm: LLM, prompt: str | Sequence[int], params: SamplingParams, *, length: int = 3,
                       num_samples: int = 3000, seed: int = 0, min_expected: float = 5.0) -> FitResult:
    """Sample through `llm` (speculation on) and fit the sequences against the target's exact probabilities."""
    if length < 2:
        raise ValueError("length must be >= 2: the first token is sampled before any drafts exist")
    prompt_ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    drafts0, accepted0 = llm.engine.num_draft_tokens, llm.engine.num_accepted_tokens
    observed = sample_sequences(llm, prompt_ids, params, length, num_samples, seed)
    probs = exact_probabilities(prompt_ids, params, length, min_expected / num_samples)
    statistic, dof, counts, expected = chi_square(observed, probs, num_samples, min_expected)
    return FitResult(num_samples, len(expected), statistic, dof, chi_square_p_value(statistic, dof), counts,
                     expected, llm.engine.num_draft_tokens - drafts0, llm.engine.num_accepted_tokens - accepted0)


def speculative_llm(speculator: str, **overrides: object) -> LLM:
    """The example model with `speculator` drafting on every step (no adaptive length, no batch-size cut-off), so
    that every request's second step verifies drafts."""
    return LLM(str(EXAMPLE), speculator=speculator, speculator_adaptive=False, speculator_max_batch_size=1 << 20,
               **overrides)


# --- negative controls: wrong verification rules the test must catch -----------------------------------------------

def _draw(probs: torch.Tensor, generator: torch.Generator | None, shared: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator if generator is not None else shared))


def accept_every_draft(target_probs: torch.Tensor, row_starts: Sequence[int], draft_ids: Sequence[Sequence[int]],
                       draft_probs: Sequence[torch.Tensor | None], generators: Sequence[torch.Generator | None],
                       shared: torch.Generator | None = None) -> list[list[int]]:
    """WRONG on purpose: keeps every draft, then a bonus token from the target (a biased proposal let through)."""
    return [[*d, _draw(target_probs[s + len(d)], g, shared)]
            for s, d, g in zip(row_starts, draft_ids, generators, strict=True)]


def resample_from_target(target_probs: torch.Tensor, row_starts: Sequence[int], draft_ids: Sequence[Sequence[int]],
                         draft_probs: Sequence[torch.Tensor | None], generators: Sequence[torch.Generator | None],
                         shared: torch.Generator | None = None) -> list[list[int]]:
    """WRONG on purpose: accepts draft j with probability min(1, p / q) as it should, but after a rejection draws
    from p instead of the residual max(0, p - q): the rejected draft gets its probability counted twice."""
    out = []
    for s, d, q_rows, g in zip(row_starts, draft_ids, draft_probs, generators, strict=True):
        kept: list[int] = []
        for j, x in enumerate(d):
            p = target_probs[s + j]
            q_x = 1.0 if q_rows is None else float(q_rows[j][x])
            u = float(torch.rand((), generator=g if g is not None else shared))
            if u * q_x < float(p[x]):
                kept.append(x)
                continue
            kept.append(_draw(p, g, shared))
            break
        else:
            kept.append(_draw(target_probs[s + len(d)], g, shared))
        out.append(kept)
    return out
