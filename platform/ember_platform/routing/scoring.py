"""The scorer interface that routing plugins implement, and the configuration that weighs them.

A scorer rates every ready replica for one request as a *cost* (lower is better; `math.inf` rules a replica
out). Costs add up across scorers after weighting, so they share one unit: tokens of work, roughly what the
replica must compute before this request's first token. The load-dependent part of a cost is given as rates
(`per_request`, `per_queued`, `per_pending`) that the tables multiply by the in-flight count and the pending
prefill tokens they read while reserving, so the load that decides is never a stale snapshot. Scorers come from
plugins through `ember_routing_scorers`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ember.errors import PluginError
from ember_platform.routing.records import Balance, ReplicaView
from ember_platform.routing.tables import DEFAULT_HOLD_S

if TYPE_CHECKING:
    from ember.plugins import PluginHost

WEIGHTS_ENV = "EMBER_ROUTING_WEIGHTS"
DEFAULT_WEIGHTS: Mapping[str, float] = {"prefix": 1.0, "load": 1.0, "lora": 1.0}


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router knows about a request: its model, its prompt's KV block hashes (the engine's hash spec,
    adapter included) and its LoRA adapter."""

    model: str
    block_hashes: tuple[bytes, ...] = ()
    num_prompt_tokens: int = 0  # 0: unknown, taken as the tokens the hashed blocks cover
    lora: str | None = None

    def prompt_tokens(self, block_size: int) -> int:
        return max(self.num_prompt_tokens, len(self.block_hashes) * block_size)


@dataclass(frozen=True, slots=True)
class Score:
    """One replica's cost for one request: a fixed part and rates per in-flight request, per queued request and
    per prompt token the replica has yet to prefill for requests already routed to it."""

    cost: float = 0.0
    per_request: float = 0.0
    per_queued: float = 0.0
    per_pending: float = 0.0

    def weighted(self, weight: float) -> Score:
        if math.isinf(self.cost):
            return self  # ruled out whatever the weight (0 * inf would be nan)
        return Score(self.cost * weight, self.per_request * weight, self.per_queued * weight,
                     self.per_pending * weight)

    def __add__(self, other: Score) -> Score:
        return Score(self.cost + other.cost, self.per_request + other.per_request, self.per_queued + other.per_queued,
                     self.per_pending + other.per_pending)

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in (self.cost, self.per_request, self.per_queued, self.per_pending))


@runtime_checkable
class Scorer(Protocol):
    """A routing scorer. Constructed with its options from the configuration as keyword arguments."""

    def score(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Sequence[Score]:
        """One Score per replica, in order."""
        ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    weight: float
    scorer: Scorer


@dataclass(frozen=True)
class RouterConfig:
    """Which scorers run, their weights and options, the imbalance bound and how long a reservation may live.

    From a mapping (e.g. a TOML table) `{"weights": {"prefix": 1, ...}, "options": {"lora": {"load_cost": 512}},
    "balance_abs": 8, "balance_rel": 1.5, "hold_s": 600}`; `EMBER_ROUTING_WEIGHTS="prefix=1,load=2"` overrides
    the weights. A weight of 0 turns a scorer off.
    """

    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    balance: Balance = field(default_factory=Balance)
    hold_s: float = DEFAULT_HOLD_S

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "routing configuration") -> RouterConfig:
        known = {"weights", "options", "balance_abs", "balance_rel", "hold_s"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key '{unknown[0]}' (known: {', '.join(sorted(known))})")
        weights = dict(data.get("weights", DEFAULT_WEIGHTS))
        for name, weight in weights.items():
            if not isinstance(weight, int | float) or weight < 0:
                raise ValueError(f"{source}: weights.{name} must be a number >= 0, got {weight!r}")
        default = Balance()
        try:
            balance = Balance(int(data.get("balance_abs", default.abs_threshold)),
                              float(data.get("balance_rel", default.rel_threshold)))
        except ValueError as e:
            raise ValueError(f"{source}: balance_abs must be >= 0 and balance_rel >= 1 ({e})") from None
        return cls(weights, dict(data.get("options", {})), balance, float(data.get("hold_s", DEFAULT_HOLD_S)))

    @classmethod
    def from_env(cls, base: RouterConfig | None = None) -> RouterConfig:
        base = base or cls()
        text = os.environ.get(WEIGHTS_ENV, "").strip()
        if not text:
            return base
        return cls({**base.weights, **parse_weights(text, source=WEIGHTS_ENV)}, base.options, base.balance,
                   base.hold_s)


def parse_weights(text: str, *, source: str = "weights") -> dict[str, float]:
    """"prefix=1,load=0.5" -> {"prefix": 1.0, "load": 0.5}."""
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or weight < 0 or not math.isfinite(weight):
            raise ValueError(f"{source}: '{item}' is not NAME=WEIGHT with a weight >= 0 (e.g. prefix=1,load=0.5)")
        weights[name.strip()] = weight
    return weights


def load_scorers(config: RouterConfig, host: PluginHost | None = None) -> list[WeightedScorer]:
    """Instantiate the configured scorers from the installed plugins (those with weight 0 are skipped)."""
    if host is None:
        from ember.plugins import PluginHost
        host = PluginHost()
    available = host.techniques.of_kind("routing_scorer")
    scorers = []
    for name, weight in config.weights.items():
        if weight == 0:
            continue
        technique = available.get(name)
        if technique is None:
            raise PluginError(f"routing weights name scorer '{name}', which no installed plugin provides "
                              f"(available: {', '.join(available) or 'none'})")
        options = dict(config.options.get(name, {}))
        try:
            scorer = technique.load()(**options)
        except TypeError as e:
            raise PluginError(f"plugin '{technique.plugin}': routing scorer '{name}' rejected its options "
                              f"{options}: {e}") from e
        if not isinstance(scorer, Scorer):
            raise PluginError(f"plugin '{technique.plugin}': routing scorer '{name}' has no score() method")
        scorers.append(WeightedScorer(name, float(weight), scorer))
    return scorers
