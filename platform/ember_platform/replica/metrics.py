"""The replica's Prometheus metrics, in a registry of its own so that one process can hold several replicas' apps.

Engine state (queue, KV blocks, prefix-cache hit rate, token counts) is read from the engine when scraped;
per-request timings are observed by the HTTP layer as outputs stream out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

COLD_START_PHASES = ("load", "quantize", "warmup", "first_token")
FINISH_REASONS = ("stop", "length", "abort", "error")

# Latency buckets from a tiny CPU model (milliseconds) up to a large model under load (a minute).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

EngineCounters = Callable[[], Mapping[str, float] | None]


class _EngineCollector(Collector):
    """Reads the engine's stats at scrape time; zeros until the engine is loaded, so every series always exists."""

    def __init__(self, engine_stats: EngineCounters) -> None:
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats: Mapping[str, float] = self._engine_stats() or {}
        total = stats.get("kv_blocks_total", 0)
        free = stats.get("kv_blocks_free", 0)
        gauges = [
            ("ember_num_requests_waiting", "Requests waiting to be scheduled (the engine's queue).",
             stats.get("num_waiting", 0)),
            ("ember_num_requests_running", "Requests in the running batch.", stats.get("num_running", 0)),
            ("ember_kv_blocks_used", "KV-cache blocks held by requests.", total - free),
            ("ember_kv_blocks_free", "KV-cache blocks free (cached prefix blocks count as free: they are evictable).",
             free),
            ("ember_kv_blocks_total", "KV-cache blocks in the pool.", total),
            ("ember_prefix_cache_hit_rate", "Share of prefix-cache lookups that found a cached block.",
             stats.get("prefix_cache_hit_rate", 0.0)),
            ("ember_spec_num_speculative_tokens", "Draft tokens per request the speculator was last asked for "
             "(chosen each step from measured acceptance and step cost; 0 while drafting does not pay).",
             stats.get("spec_num_speculative_tokens", 0)),
            ("ember_spec_acceptance_rate", "Share of speculative draft tokens the target accepted.",
             stats.get("spec_acceptance_rate", 0.0)),
            ("ember_spec_mean_accepted_length", "Tokens a request got per verifying step (accepted drafts + 1).",
             stats.get("spec_mean_accepted_length", 0.0)),
        ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        counters = [
            ("ember_generation_tokens", "Tokens generated for requests (the warm-up's excluded).",
             stats.get("generated_tokens", 0)),
            ("ember_spec_draft_tokens", "Speculative draft tokens proposed.", stats.get("spec_draft_tokens", 0)),
            ("ember_spec_accepted_tokens", "Speculative draft tokens the target model accepted.",
             stats.get("spec_accepted_tokens", 0)),
            ("ember_prefix_cache_queried_tokens", "Tokens of admitted requests looked up in the prefix cache.",
             stats.get("prefix_cache_queried_tokens", 0)),
            ("ember_prefix_cache_hit_tokens", "Looked-up tokens found in the prefix cache, not computed (n choices "
             "of one prompt hit it for the prompt their first choice computed).",
             stats.get("prefix_cache_hit_tokens", 0)),
            ("ember_grammars_compiled", "Output constraints (schemas, regexes, grammars) compiled.",
             stats.get("grammars_compiled", 0)),
            ("ember_grammar_cache_hits", "Output constraints found compiled already (one compile per schema).",
             stats.get("grammar_cache_hits", 0)),
        ]
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


class ReplicaMetrics:
    """Every metric of one replica; `render()` is the body of GET /metrics."""

    def __init__(self, engine_stats: EngineCounters, in_flight: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens of requests sent to the engine.",
                                     registry=r)
        self.requests_finished = Counter("ember_requests_finished", "Finished requests by finish reason "
                                         "(abort: the client went away; error: the engine failed).",
                                         ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)
        self.time_to_first_token = Histogram("ember_time_to_first_token_seconds",
                                             "From a request reaching the engine to its first token.",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("ember_inter_token_latency_seconds",
                                             "Between successive tokens of a request (tokens that arrive together "
                                             "share the gap).", buckets=_ITL_BUCKETS, registry=r)
        self.request_latency = Histogram("ember_request_latency_seconds",
                                         "From a request reaching the engine to its end.",
                                         buckets=_REQUEST_BUCKETS, registry=r)
        self.cold_start = Gauge("ember_cold_start_seconds", "Seconds the replica's cold start spent per phase "
                                "(first_token: from the replica starting until its warm-up's first token).",
                                ["phase"], registry=r)
        self.requests_in_flight = Gauge("ember_requests_in_flight", "Generation requests being served over HTTP.",
                                        registry=r)
        self.requests_in_flight.set_function(in_flight)
        self.registry.register(_EngineCollector(engine_stats))

    def set_cold_start(self, timings: Mapping[str, Any]) -> None:
        for phase in COLD_START_PHASES:
            if timings.get(phase) is not None:
                self.cold_start.labels(phase).set(timings[phase])

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
