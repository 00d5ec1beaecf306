"""How many tokens to draft each step: the number that maximizes decode tokens per second, from the acceptance the
drafts have had and what a target pass measurably costs at this batch size, zero when drafting does not pay.

Speculation trades compute for latency: verifying k drafts per request makes the target pass k + 1 times wider.
At batch 1 a pass is bound by reading the weights, so a wider one costs little more and accepted drafts are nearly
free tokens; at large batch it is bound by compute, a wider pass costs about k + 1 times as much, and drafts slow
serving down (the most frequent complaint about speculation in production). A static batch-size cut-off gets
this wrong both ways, on other hardware, models or workloads, so the choice is made from measurements:

* acceptance per draft position (`p_j`: how often draft j is accepted once drafts 1..j-1 were), so the expected
  tokens a request gets from a step with k drafts is `E(k) = 1 + sum_j prod_{i<=j} p_i`, whatever the speculator;
* the wall time of a step as a function of its scheduled tokens, interpolated between measured sizes (and beyond
  the largest one measured, as if cost grew in proportion: pessimistic, so untested widths are not bet on);
* the speculator's own time per step for each k (a draft model's cost grows with k; prompt lookup costs ~0).

For tree drafts (spec_tree.py; `tree=True`) k is the node budget: a step verifies 1 + k tokens per request, as
a chain of k does, so the cost side is the same; the gain is measured per budget position instead: speculators
order their nodes best first (any prefix is a tree), so a request whose accepted path went through nodes
i_1 < i_2 < ... would, with a budget of k, have kept the path's nodes below k. `g_j`, how often node j - 1 was on
the accepted path (among requests given at least j nodes), gives `E(k) = 1 + sum_{j<=k} g_j` (for a chain this is
the formula above).

It then picks `argmax_k B * E(k) / (T(other + B * (k + 1)) + D(k))` for B decoding requests. Measurements decay
(the load changes), and a step now and then drafts the full k, so that acceptance and the cost of wide passes
stay measured even while they do not pay, and one now and then drafts none (as does the first step at a width
whose plain pass was never measured), so that what speculation is compared with stays measured too. There is no
batch-size cut-off: `[speculator] max_batch_size` is an optional ceiling a user may set above this.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

DECAY = 0.98  # each new step-cost observation weighs 2%: a memory of about 50 steps per size class
ACCEPTANCE_DECAY = 0.995  # per verified request: about 200 requests' drafts of memory
PROBE_EVERY = 64  # one step in this many drafts the full k, to keep measuring what is not chosen
WARMUP_STEPS = 8  # the first steps draft the full k: nothing is measured yet
# Warm-up and probe steps draft for this many requests of the batch only (rotating): enough to keep acceptance
# measured, while at a large batch a probe of every request would cost k + 1 times a step each time (~5% of the
# throughput at batch 32 with k = 3, probing every 64 steps). Wider passes at large batch stay unmeasured, so their
# predicted cost is the pessimistic extrapolation: drafts there are not bet on.
PROBE_REQUESTS = 2


@dataclass(slots=True)
class _Average:
    """A decaying average of observations."""

    weight: float = 0.0
    total: float = 0.0

    def add(self, value: float, decay: float = DECAY) -> None:
        self.weight = self.weight * decay + 1.0
        self.total = self.total * decay + value

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight else None


class StepCost:
    """Wall time of a step by its number of scheduled tokens: one decaying average per power-of-two size class."""

    def __init__(self) -> None:
        self._time: dict[int, _Average] = {}
        self._size: dict[int, _Average] = {}

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        size_class = num_tokens.bit_length()
        self._time.setdefault(size_class, _Average()).add(seconds)
        self._size.setdefault(size_class, _Average()).add(float(num_tokens))

    def measured(self, num_tokens: int) -> bool:
        return num_tokens.bit_length() in self._time

    def predict(self, num_tokens: int) -> float | None:
        """Seconds for a step of `num_tokens`; None before any step was measured."""
        points = sorted((self._size[c].value, self._time[c].value) for c in self._time)  # type: ignore[misc]
        if not points:
            return None
        if num_tokens <= points[0][0]:
            return points[0][1]  # below the smallest size measured: a pass costs at least that
        for (n0, t0), (n1, t1) in itertools.pairwise(points):
            if num_tokens <= n1:
                return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0) if n1 > n0 else max(t0, t1)
        n_max, t_max = points[-1]
        if num_tokens.bit_length() <= max(self._time):  # within the largest size class measured: its local slope
            slope = max(0.0, (t_max - points[-2][1]) / (n_max - points[-2][0])) if len(points) > 1 else 0.0
            return t_max + slope * (num_tokens - n_max)
        return t_max * num_tokens / n_max  # beyond what was measured: as if compute-bound (pessimistic)


class SpeculationLength:
    """Chooses each step's number of drafts per request (0..max_k) and keeps the figures metrics report."""

    def __init__(self, max_k: int, *, adaptive: bool = True, tree: bool = False) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.tree = tree
        self.cost = StepCost()
        self._draft_time = [_Average() for _ in range(max_k + 1)]
        # Acceptance per draft position, starting from an even prior (one accepted of two reached).
        self._reached = [2.0] * (max_k + 1)
        self._accepted = [1.0] * (max_k + 1)
        if tree:  # marginals (see the module docstring), from the same prior: prod_{i<=j} 1/2
            self._accepted = [2.0 * 0.5 ** j for j in range(max_k + 1)]
        self._steps = 0
        self.k = max_k  # the last choice
        self.probing = False  # the last choice was a warm-up or probe step (see PROBE_REQUESTS)
        self.num_verified = 0  # requests whose drafts were verified
        self.num_drafted = 0
        self.num_accepted = 0

    # --- what was observed --------------------------------------------------------------------

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A target pass (with sampling and verification) over `num_tokens` scheduled tokens took `seconds`."""
        self.cost.record(num_tokens, seconds)

    def record_draft(self, k: int, seconds: float) -> None:
        """The speculator took `seconds` to propose this step's drafts of up to `k` tokens."""
        if 0 < k <= self.max_k and math.isfinite(seconds) and seconds >= 0:
            self._draft_time[k].add(seconds)

    def record_verified(self, num_drafted: int, num_accepted: int, path: list[int] | None = None) -> None:
        """One request's drafts were verified: `num_accepted` of its `num_drafted` were kept (`path`: the accepted
        nodes of a tree, None for a chain: its first `num_accepted`)."""
        if num_drafted <= 0:
            return
        self.num_verified += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if self.tree:
            on_path = set(range(num_accepted) if path is None else path)
            for j in range(1, min(num_drafted, self.max_k) + 1):
                self._reached[j] = self._reached[j] * ACCEPTANCE_DECAY + 1.0
                self._accepted[j] = self._accepted[j] * ACCEPTANCE_DECAY + (1.0 if j - 1 in on_path else 0.0)
            return
        for j in range(1, min(num_drafted, self.max_k) + 1):
            if j > num_accepted + 1:
                break  # never reached: an earlier draft was rejected
            self._reached[j] = self._reached[j] * ACCEPTANCE_DECAY + 1.0
            self._accepted[j] = self._accepted[j] * ACCEPTANCE_DECAY + (1.0 if j <= num_accepted else 0.0)

    # --- the choice ---------------------------------------------------------------------------

    def expected_tokens(self, k: int) -> float:
        """Tokens one request is expected to get from a step with `k` drafts (1 with none)."""
        expected, survive = 1.0, 1.0
        if self.tree:
            return expected + sum(self._accepted[j] / self._reached[j] for j in range(1, k + 1))
        for j in range(1, k + 1):
            survive *= self._accepted[j] / self._reached[j]
            expected += survive
        return expected

    def _draft_seconds(self, k: int) -> float:
        measured = [(j, a.value) for j, a in enumerate(self._draft_time) if a.value is not None]
        if not measured or k == 0:
            return 0.0
        if self._draft_time[k].value is not None:
            return self._draft_time[k].value  # type: ignore[return-value]
        j, seconds = min(measured, key=lambda m: abs(m[0] - k))
        return seconds * k / j  # an autoregressive drafter's cost grows with the tokens it drafts

    def choose(self, num_decoding: int, other_tokens: int = 0) -> int:
        """Drafts per request for a step of `num_decoding` requests decoding plus `other_tokens` (prefill chunks).
        After a warm-up or probe step (`probing`), only `probe_subset` of the requests should get them."""
        if not self.adaptive:
            return self.max_k
        if num_decoding < 1:
            return 0
        self._steps += 1
        self.probing = self._steps <= WARMUP_STEPS or self._steps % PROBE_EVERY == 0
        if self.probing:
            self.k = self.max_k
            return self.k
        # A pass without drafts at this width never measured (warm-up drafts the full k), or not for a while: run
        # one. Below the narrowest width measured the cost model assumes that width's cost, which would make
        # drafting look free; one plain step now and then keeps the comparison with no speculation measured.
        if not self.cost.measured(other_tokens + num_decoding) or self._steps % PROBE_EVERY == PROBE_EVERY // 2:
            self.k = 0
            return 0
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            seconds = self.cost.predict(other_tokens + num_decoding * (k + 1))
            if seconds is None:
                return self.max_k  # nothing measured yet
            rate = num_decoding * self.expected_tokens(k) / (seconds + self._draft_seconds(k))
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.k = best_k
        return best_k

    def probe_subset(self, eligible: list[int]) -> list[int]:
        """The requests a warm-up or probe step drafts for: PROBE_REQUESTS of them, rotating through the batch."""
        if not self.probing or len(eligible) <= PROBE_REQUESTS:
            return eligible
        start = (self._steps * PROBE_REQUESTS) % len(eligible)
        return [eligible[(start + i) % len(eligible)] for i in range(PROBE_REQUESTS)]

    # --- what metrics report ------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """Of all drafted tokens, the share the target accepted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request got per step on average: its accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted / self.num_verified if self.num_verified else 0.0
