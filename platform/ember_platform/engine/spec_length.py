"""How many tokens to draft each step: the number that maximizes decode tokens per second, from the acceptance the
drafts have had and what a target pass measurably costs at this batch size, zero when drafting does not pay.

Speculation trades compute for latency: verifying k drafts per request makes the target pass k + 1 times wider.
At batch 1 a pass is bound by reading the weights, so a wider one costs little more and accepted drafts are nearly
free tokens; at large batch it is bound by compute, a wider pass costs about k + 1 times as much, and drafts slow
serving down (the most frequent complaint about speculation in production). A static batch-size cut-off gets
this wrong both ways, on other hardware, models or workloads, so the choice is made from measurements:

* acceptance per draft position (`p_j`: how often draft j is accepted once drafts 1..j-1 were), so the expected
  tokens a request gets from a step with k drafts is `E(k) = 1 + sum_j prod_{i<=j} p_i`, whatever the speculator;
* the time of a step, fitted (`StepCost`) as `a + r * requests + v * drafts + p * prefill tokens`: a draft is a
  row verified and sampled, a prefill token one that runs through the layers only (no LM head, no sampling, its
  attention batched over a chunk), so the two are priced apart. Priced by token count alone, the cheap tokens of
  prefill-heavy steps made a wide decode step look cheap: at batch 32 on a CPU, where a draft costs about what a
  decoding request does, prompt lookup drafted 3 tokens on most steps and ran at 0.93x of no speculation.
  Requests that sample (temperature > 0) and greedy ones are priced apart too (`r` and `v` for each), and their
  acceptance is measured apart: a sampled row is filtered (top-k/top-p), normalized and drawn, and a sampled
  draft verified by rejection sampling, which on a CPU made a batch of 32 sampled requests' step 1.8x a greedy
  one's (the example model: +0.3 ms a sampled row). With one price, drafts measured on a greedy batch (cheap)
  were carried into a batch half sampled, where they cost twice that for less acceptance: Medusa, drafting at
  uniform batch 32 (1.2x), then ran a mixed greedy/sampled batch of 32 at 0.80-0.85x. Each class then gets its
  own length (`lengths`); a class never measured drafting is priced by the pessimistic prior below;
* the speculator's own time (`DraftCost`: `c + e * k + f * requests * k`; a draft model's and EAGLE's passes grow
  with k, Medusa's heads with the rows they read; prompt lookup costs ~0).

For tree drafts (spec_tree.py; `tree=True`) k is the node budget: a step verifies 1 + k tokens per request, as
a chain of k does, so the cost side is the same; the gain is measured per budget position instead: speculators
order their nodes best first (any prefix is a tree), so a request whose accepted path went through nodes
i_1 < i_2 < ... would, with a budget of k, have kept the path's nodes below k. `g_j`, how often node j - 1 was on
the accepted path (among requests given at least j nodes), gives `E(k) = 1 + sum_{j<=k} g_j` (for a chain this is
the formula above).

It then picks `argmax (B_g * E_g(k_g) + B_s * E_s(k_s)) / (T + D)` over a length for the B_g greedy and one for the B_s
sampled decoding requests, T without prefill: a prompt's work is the same however many steps its request's decoding
takes (and which prompts the next step brings is not known when its drafts are made). Measurements decay (the load
changes), and a step now and then drafts the full k for a few requests, so that acceptance and the cost of drafts stay
measured even while they do not pay (less and less often while each such probe confirms they do not: a probe costs a
model-backed drafter a pass over the probed requests' contexts), and one now and then drafts none, so that what
speculation is compared with stays measured too, at each batch size (MIN_PLAIN: soon after the batch changes). While
drafts pay, the position just past the chosen length is probed often until it is measured (MIN_REACHED): only probes
ever measure it. A direction the measurements do not tell apart (only plain steps seen, say) is priced pessimistically,
every token at the average cost per token seen, as if compute-bound: a draft is not bet on before it was measured. The
same logic keeps k high where a wider pass is nearly free (a GPU at moderate batch: `v` measures ~0). There is no
batch-size cut-off: `[speculator] max_batch_size` is an optional ceiling a user may set above this.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

DECAY = 0.99  # each step's cost weighs 1%: about 100 steps of memory, a probe's measurement outlives the next probe
ACCEPTANCE_DECAY = 0.995  # per verified request: about 200 requests' drafts of memory
PROBE_EVERY = 64  # one step in this many drafts the full k, to keep measuring what is not chosen
# ... while drafts pay. A probe that finds they do not (best length 0) doubles the interval, up to this many steps:
# a probe of a model-backed drafter brings its cache up to date for the probed requests (a pass over their whole
# context), so at batch 32 on a CPU probing every 64 steps cost ~3% of the throughput, which a measurement that
# keeps saying "no" does not buy. A step whose batch the measurements say drafts pay at (best length > 0) goes back
# to PROBE_EVERY; one with a batch half the size of the last probe's or less probes at once.
MAX_PROBE_EVERY = 1024
WARMUP_STEPS = 8  # the first steps draft the full k: nothing is measured yet
# Warm-up and probe steps draft the full k for this many requests of the batch only (rotating; the others get the
# length chosen): enough to keep acceptance and the cost of a draft measured, while at a large batch a probe of
# every request would cost k + 1 times a step each time (~5% of the throughput at batch 32 with k = 3, probing
# every 64 steps).
PROBE_REQUESTS = 2
# The draft position just past the chosen length is measured only by probes (a request drafting k drafts tells
# nothing of draft k + 1). While drafts pay (a length >= 1 chosen) and that position has been reached fewer than
# MIN_REACHED times (its prior's 2 included), every EXPLORE_EVERY-th step probes, so that a few unlucky first drafts
# do not keep the length short for hundreds of steps: at batch 1 the example's EAGLE-3 and Medusa each stayed at
# k = 1 for 100-500 steps of a ~600-step run in about one run of three (draft 2 measured 0.17-0.33 from a handful
# of early samples, ~0.8 once measured), at ~0.7x the tokens per step of the runs that did not. A position is
# reached at most once per probed request, so this ends after about MIN_REACHED probes of each position, and after
# MAX_EXPLORE_PROBES in all (a position behind drafts that are almost never accepted may never be reached that
# often, and then hardly matters). Where no length pays, probes keep their backing-off interval: a probe there
# widens a pass that measured too costly already.
MIN_REACHED = 24.0
EXPLORE_EVERY = 2
MAX_EXPLORE_PROBES = 128
EXPLORE_GAIN = 0.02  # ... and only while such drafts, all accepted, would beat the chosen length by this much
# What a step without drafts costs at this batch size must be measured, not extrapolated: the fit is linear in the
# requests, so from batch 1 alone (a pass bound by reading the weights: all intercept) it priced a plain step of 8
# requests at ~8 ms where it takes ~4.5, and drafts at batch 8 looked as if they paid (eagle3 0.71-0.92x there).
# While the plain steps of batches within PLAIN_NEAR of this one weigh less than MIN_PLAIN (each decays as a step's
# cost does), a step goes without drafts, at most one in PLAIN_SPACING. In a steady batch that is one step in 69
# (one in N keeps a weight of 1 / (1 - DECAY ** N)); right after the batch changes, a few steps in its first dozen.
MIN_PLAIN = 2.0
PLAIN_NEAR = 1.5
PLAIN_SPACING = 4
PLAIN_KEPT = 32  # the most recent plain steps remembered: more than enough to reach MIN_PLAIN where it can be
# The pull of the pessimistic prior on each fitted coefficient, in observations of that feature's mean square: it
# decides only directions the measurements leave open.
RIDGE = 0.002
SOLVE_EVERY = 4


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


class _DecayingFit:
    """Least squares `seconds ~ theta . features` over decaying observations, pulled (RIDGE) toward a prior that
    prices every unit of `per_unit` features at the average seconds per unit observed (compute-bound: pessimistic).
    Solved again every SOLVE_EVERY observations (a solve costs about what a few small ops of a step do)."""

    def __init__(self, num_features: int, per_unit: Sequence[int], decay: float = DECAY) -> None:
        self.n = num_features
        self.per_unit = tuple(per_unit)
        self.decay = decay
        # Sums of weighted observations, the newest weighing `_scale`, each older one `decay` times less (growing
        # the new weight instead of shrinking every sum: an observation is then a few additions).
        self._pairs = [(i, j) for i in range(num_features) for j in range(i, num_features)]
        self._xx = [0.0] * len(self._pairs)
        self._xy = [0.0] * num_features
        self._weight = self._seconds = self._units = 0.0
        self._scale = 1.0
        self._theta: tuple[float, ...] | None = None
        self._since_solve = 0

    def add(self, x: Sequence[float], seconds: float) -> None:
        self._scale /= self.decay
        if self._scale > 1e100:  # renormalize (every ~23,000 observations at DECAY)
            self._rescale(1.0 / self._scale)
        g = self._scale
        xx = self._xx
        for p, (i, j) in enumerate(self._pairs):
            xx[p] += g * x[i] * x[j]
        for i in range(self.n):
            self._xy[i] += g * x[i] * seconds
        self._weight += g
        self._seconds += g * seconds
        self._units += g * sum(x[j] for j in self.per_unit)
        self._since_solve += 1

    def _rescale(self, factor: float) -> None:
        self._xx = [v * factor for v in self._xx]
        self._xy = [v * factor for v in self._xy]
        self._weight *= factor
        self._seconds *= factor
        self._units *= factor
        self._scale *= factor

    @property
    def empty(self) -> bool:
        return self._weight == 0.0

    def theta(self) -> tuple[float, ...]:
        if self._theta is None or self._since_solve >= SOLVE_EVERY:
            self._theta = tuple(self._solve())
            self._since_solve = 0
        return self._theta

    def _solve(self) -> list[float]:
        n = self.n
        xx = [[0.0] * n for _ in range(n)]
        for p, (i, j) in enumerate(self._pairs):
            xx[i][j] = xx[j][i] = self._xx[p]
        per_unit = self._seconds / self._units if self._units > 0 else 0.0
        xy = list(self._xy)
        for i in range(n):
            # RIDGE observations of the newest weight, at each feature's mean square, pulling toward the prior
            ridge = RIDGE * self._scale * max(xx[i][i] / self._weight, 1.0)
            xx[i][i] += ridge
            if i in self.per_unit:
                xy[i] += ridge * per_unit
        return _solve_small(xx, xy)


def _solve_small(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b, by Gaussian elimination with partial pivoting, in place: for the 3-4 unknowns of a fit, plain
    Python is ~10x faster than numpy's LAPACK call with its array set-up (~115 us per solve, every few steps)."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if pivot != col:
            a[col], a[pivot] = a[pivot], a[col]
            b[col], b[pivot] = b[pivot], b[col]
        head = a[col][col]  # never 0: the ridge makes the system positive definite
        for r in range(col + 1, n):
            factor = a[r][col] / head
            if factor:
                row, top = a[r], a[col]
                for c in range(col, n):
                    row[c] -= factor * top[c]
                b[r] -= factor * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


class StepCost:
    """Seconds of a target step (pass, sampling, verification) as `a + r_g * greedy requests + r_s * sampled
    requests + v_g * greedy drafts + v_s * sampled drafts + p * prefill`: `requests` scheduled (`sampled_requests`
    of them drawing a token at temperature > 0 this step), `drafts` verified (`sampled_drafts` of them by rejection
    sampling), and `prefill` the tokens beyond one per request (prompt chunks)."""

    def __init__(self) -> None:
        self._fit = _DecayingFit(6, per_unit=(1, 2, 3, 4, 5))
        self.num_steps = 0

    def record(self, seconds: float, *, requests: int, drafts: int, prefill: int, sampled_requests: int = 0,
               sampled_drafts: int = 0) -> None:
        if requests < 1 or drafts < 0 or prefill < 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        if not (0 <= sampled_requests <= requests and 0 <= sampled_drafts <= drafts):
            return
        self._fit.add((1.0, float(requests - sampled_requests), float(sampled_requests),
                       float(drafts - sampled_drafts), float(sampled_drafts), float(prefill)), seconds)
        self.num_steps += 1

    def draft_prices(self) -> tuple[float, float]:
        """What one more verified draft adds to a step, (greedy, sampled), never below 0 (noise does not make drafts
        pay); (0, 0) before any step was measured."""
        if self._fit.empty:
            return 0.0, 0.0
        theta = self._fit.theta()
        return max(0.0, theta[3]), max(0.0, theta[4])

    def predict(self, requests: int, drafts: int, prefill: int = 0, *, sampled_requests: int = 0,
                sampled_drafts: int = 0) -> float | None:
        """Seconds for such a step; None before any step was measured."""
        if self._fit.empty:
            return None
        a, r_greedy, r_sampled, v_greedy, v_sampled, p = self._fit.theta()
        plain = a + r_greedy * (requests - sampled_requests) + r_sampled * sampled_requests + max(0.0, p) * prefill
        return (max(plain, 1e-9) + max(0.0, v_greedy) * (drafts - sampled_drafts)
                + max(0.0, v_sampled) * sampled_drafts)


class DraftCost:
    """Seconds the speculator takes to propose `k` drafts for `requests` requests: `c + e * k + f * requests * k`
    (one call; k passes of a draft model or EAGLE head; the rows a head or pass reads)."""

    def __init__(self) -> None:
        self._fit = _DecayingFit(3, per_unit=(2,))

    def record(self, k: int, requests: int, seconds: float) -> None:
        if k > 0 and requests > 0 and math.isfinite(seconds) and seconds >= 0:
            self._fit.add((1.0, float(k), float(requests * k)), seconds)

    def predict(self, k: int, requests: int) -> float:
        if k == 0 or self._fit.empty:
            return 0.0
        c, e, f = self._fit.theta()
        return max(0.0, c + e * k + f * requests * k)


GREEDY, SAMPLED = 0, 1  # the two classes of requests priced and measured apart (module docs)


class SpeculationLength:
    """Chooses each step's number of drafts per request (0..max_k) and keeps the figures metrics report."""

    def __init__(self, max_k: int, *, adaptive: bool = True, tree: bool = False) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.tree = tree
        self.cost = StepCost()
        self.draft_cost = DraftCost()
        # Acceptance per draft position and class (GREEDY, SAMPLED), from an even prior (one accepted of two reached).
        self._reached = [[2.0] * (max_k + 1) for _ in (GREEDY, SAMPLED)]
        self._accepted = [[1.0] * (max_k + 1) for _ in (GREEDY, SAMPLED)]
        if tree:  # marginals (see the module docstring), from the same prior: prod_{i<=j} 1/2
            self._accepted = [[2.0 * 0.5 ** j for j in range(max_k + 1)] for _ in (GREEDY, SAMPLED)]
        self._steps = 0
        self._probe_every = PROBE_EVERY  # grows while probes find drafts do not pay (MAX_PROBE_EVERY)
        self._next_probe = PROBE_EVERY
        self._probe_batch = 0  # decoding requests at the last probe
        self._last_probe = 0  # the step of the last probe
        self._plain: deque[tuple[int, int]] = deque(maxlen=PLAIN_KEPT)  # (requests, step) of recent plain steps
        self._explore_probes = 0  # probes made because the next position was under-measured (MIN_REACHED)
        self._num_sampled = 0  # of the last choice's decoding requests
        self.k = max_k  # the last step's drafts per request (the most any request got)
        self.best = (max_k, max_k)  # the last lengths chosen from the measurements, (greedy, sampled)
        self._best_rate = 0.0  # their predicted rate per request
        self.probing = False  # the last choice was a warm-up or probe step (see PROBE_REQUESTS)
        self.num_verified = 0  # requests whose drafts were verified
        self.num_drafted = 0
        self.num_accepted = 0

    @property
    def best_k(self) -> int:
        """The longer of the last lengths chosen from the measurements."""
        return max(self.best)

    # --- what was observed --------------------------------------------------------------------

    def record_step(self, num_tokens: int, seconds: float, *, requests: int, drafts: int, sampled_requests: int = 0,
                    sampled_drafts: int = 0) -> None:
        """A target pass (with sampling and verification) over `num_tokens` scheduled tokens took `seconds`: one
        or more for each of `requests` requests, `drafts` of them drafts to verify, the rest prompt chunks;
        `sampled_requests` of the requests drew a token at temperature > 0, `sampled_drafts` of the drafts theirs."""
        self.cost.record(seconds, requests=requests, drafts=drafts, prefill=max(0, num_tokens - requests - drafts),
                         sampled_requests=sampled_requests, sampled_drafts=sampled_drafts)
        if drafts == 0:
            self._plain.append((requests, self._steps))

    def record_draft(self, k: int, seconds: float, *, requests: int) -> None:
        """The speculator took `seconds` to propose drafts of up to `k` tokens for `requests` requests."""
        if 0 < k <= self.max_k:
            self.draft_cost.record(k, requests, seconds)

    def record_verified(self, num_drafted: int, num_accepted: int, path: list[int] | None = None, *,
                        sampled: bool = False) -> None:
        """One request's drafts were verified: `num_accepted` of its `num_drafted` were kept (`path`: the accepted
        nodes of a tree, None for a chain: its first `num_accepted`); `sampled`: by rejection sampling."""
        if num_drafted <= 0:
            return
        self.num_verified += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        reached, accepted = self._reached[int(sampled)], self._accepted[int(sampled)]
        if self.tree:
            on_path = set(range(num_accepted) if path is None else path)
            for j in range(1, min(num_drafted, self.max_k) + 1):
                reached[j] = reached[j] * ACCEPTANCE_DECAY + 1.0
                accepted[j] = accepted[j] * ACCEPTANCE_DECAY + (1.0 if j - 1 in on_path else 0.0)
            return
        for j in range(1, min(num_drafted, self.max_k) + 1):
            if j > num_accepted + 1:
                break  # never reached: an earlier draft was rejected
            reached[j] = reached[j] * ACCEPTANCE_DECAY + 1.0
            accepted[j] = accepted[j] * ACCEPTANCE_DECAY + (1.0 if j <= num_accepted else 0.0)

    # --- the choice ---------------------------------------------------------------------------

    def expected_tokens(self, k: int, *, sampled: bool = False) -> float:
        """Tokens one request (greedy, or `sampled`) is expected to get from a step with `k` drafts (1 with none)."""
        return self._expected(int(sampled))[k]

    def _expected(self, cls: int, accepted_from: int | None = None) -> list[float]:
        """E(0..max_k) for a class; `accepted_from`: as if every draft from that position on were accepted."""
        reached, accepted = self._reached[cls], self._accepted[cls]
        out, expected, survive = [1.0], 1.0, 1.0
        for j in range(1, self.max_k + 1):
            if accepted_from is not None and j >= accepted_from:
                expected += 1.0 if self.tree else survive
            elif self.tree:
                expected += accepted[j] / reached[j]
            else:
                survive *= accepted[j] / reached[j]
                expected += survive
            out.append(expected)
        return out

    def choose(self, num_decoding: int, num_sampled: int = 0) -> int:
        """The most drafts any of the next step's `num_decoding` decoding requests (`num_sampled` of them sampling
        at temperature > 0) gets; `lengths` says which gets how many (a warm-up or probe step, `probing`, gives the
        full k to a few of them only; greedy and sampled requests may get different lengths otherwise)."""
        if not self.adaptive:
            self.k = self.max_k
            return self.k
        if num_decoding < 1:
            return 0
        num_sampled = self._num_sampled = min(max(num_sampled, 0), num_decoding)
        self._steps += 1
        warm_up = self._steps <= WARMUP_STEPS
        if warm_up:
            self.best, self._best_rate = (0, 0), 0.0
        else:
            k_greedy, k_sampled, self._best_rate = self._best(num_decoding - num_sampled, num_sampled)
            self.best = (k_greedy, k_sampled)
        self.probing = warm_up or self._probe_due(num_decoding)
        if self.probing:
            self.k = self.max_k
        elif self.best_k and self._plain_unmeasured(num_decoding):
            # While every step drafts, the cost of a step without drafts would be known only through the fit's split
            # of wider ones, extrapolated from other batch sizes (MIN_PLAIN).
            self.best, self.k = (0, 0), 0
        else:
            self.k = self.best_k
        return self.k

    def _plain_unmeasured(self, num_decoding: int) -> bool:
        """Whether the plain steps of batches near `num_decoding` weigh less than MIN_PLAIN (module docs)."""
        if self._plain and self._steps - self._plain[-1][1] < PLAIN_SPACING:
            return False
        weight = 0.0
        for n, step in reversed(self._plain):
            if num_decoding <= n * PLAIN_NEAR and n <= num_decoding * PLAIN_NEAR:
                weight += DECAY ** (self._steps - step)
                if weight >= MIN_PLAIN:
                    return False
        return True

    def _probe_due(self, num_decoding: int) -> bool:
        """Whether this step probes (see MAX_PROBE_EVERY for how the interval adapts)."""
        if 2 * num_decoding <= self._probe_batch:  # another regime: measure it now
            self._probe_every, self._next_probe = PROBE_EVERY, self._steps
        elif self.best_k:
            self._probe_every = PROBE_EVERY
            self._next_probe = min(self._next_probe, self._steps + PROBE_EVERY)
        explore = self._steps - self._last_probe >= EXPLORE_EVERY and self._under_measured(num_decoding)
        if self._steps < self._next_probe and not explore:
            return False
        if self._steps < self._next_probe:  # early, to measure the next position (not a probe of the regime)
            self._explore_probes += 1
            self._last_probe = self._steps
            return True
        self._last_probe = self._steps
        if not self.best_k:
            self._probe_every = min(2 * self._probe_every, MAX_PROBE_EVERY)
        self._next_probe = self._steps + self._probe_every
        self._probe_batch = num_decoding
        return True

    def _under_measured(self, num_decoding: int) -> bool:
        """Whether, for a class of this batch, the draft position past its chosen length has too few measurements to
        judge (MIN_REACHED), and judging it could change the length: drafts accepted every time from there on would
        pay more than the lengths chosen (EXPLORE_GAIN). Where they would not (a pass bound by compute, a drafter
        costlier than what its drafts could save), measuring them buys nothing."""
        if self._explore_probes >= MAX_EXPLORE_PROBES:
            return False
        num_sampled = self._num_sampled
        for cls, n in ((GREEDY, num_decoding - num_sampled), (SAMPLED, num_sampled)):
            k = self.best[cls]
            if not n or not 0 < k < self.max_k or self._reached[cls][k + 1] >= MIN_REACHED:
                continue
            *lengths, rate = self._best(num_decoding - num_sampled, num_sampled, explore=(cls, k + 1))
            if lengths[cls] > k and rate > (1.0 + EXPLORE_GAIN) * self._best_rate:
                return True
        return False

    def _best(self, num_greedy: int, num_sampled: int,
              explore: tuple[int, int] | None = None) -> tuple[int, int, float]:
        """The (greedy, sampled) lengths of the highest predicted decode tokens per second, and that rate per request
        (written out: it runs every step). Prefill is left out: its work is the same however many steps the decoding
        takes, so what drafts can shorten is the decoding part (the fit prices the two apart). `explore` (class,
        position): as if every draft of that class from that position on were accepted."""
        num_decoding = num_greedy + num_sampled
        plain = self.cost.predict(num_decoding, 0, sampled_requests=num_sampled)
        if plain is None:
            return self.max_k, self.max_k, 0.0  # nothing measured yet
        per_greedy, per_sampled = self.cost.draft_prices()
        # E(k) of each class (a class the batch lacks only at k = 0, where it weighs nothing)
        greedy, sampled = (self._expected(cls, explore[1] if explore and explore[0] == cls else None) if n else (1.0,)
                           for cls, n in ((GREEDY, num_greedy), (SAMPLED, num_sampled)))
        best = (0, 0, num_decoding / plain)
        for k_greedy in range(self.max_k + 1) if num_greedy else (0,):
            for k_sampled in range(self.max_k + 1) if num_sampled else (0,):
                if not k_greedy and not k_sampled:
                    continue
                drafting = (num_greedy if k_greedy else 0) + (num_sampled if k_sampled else 0)
                seconds = (plain + per_greedy * num_greedy * k_greedy + per_sampled * num_sampled * k_sampled
                           + self.draft_cost.predict(max(k_greedy, k_sampled), drafting))
                rate = (num_greedy * greedy[k_greedy] + num_sampled * sampled[k_sampled]) / seconds
                if rate > best[2]:
                    best = (k_greedy, k_sampled, rate)
        return best[0], best[1], best[2] / num_decoding

    def lengths(self, num_eligible: int, sampled: Sequence[bool] | None = None) -> list[int]:
        """Drafts for each of the step's `num_eligible` decoding requests (in batch order; `sampled`: which of them
        sample at temperature > 0) after `choose`: the length chosen for its class, and on a warm-up or probe step
        the full k for PROBE_REQUESTS of them, rotating through the batch (the others get the length chosen: none
        during the warm-up)."""
        if (self.probing and num_eligible <= PROBE_REQUESTS) or not self.adaptive:
            return [self.k] * num_eligible
        flags = sampled if sampled is not None else [False] * num_eligible
        out = [self.best[SAMPLED] if s else self.best[GREEDY] for s in flags]
        if self.probing:
            start = (self._steps * PROBE_REQUESTS) % num_eligible
            for i in range(PROBE_REQUESTS):
                out[(start + i) % num_eligible] = self.max_k
        return out

    # --- what metrics report ------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """Of all drafted tokens, the share the target accepted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request got per step on average: its accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted / self.num_verified if self.num_verified else 0.0
