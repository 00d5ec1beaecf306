"""The gateway's Prometheus metrics (a registry of its own): requests by model and status, upstream latency,
and, read from the control plane when scraped, waiting requests and replicas by state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember_platform.control.deployments import ReplicaState

if TYPE_CHECKING:
    from ember_platform.control.plane import ControlPlane

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _PlaneCollector(Collector):
    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("ember_gateway_requests_waiting", "Requests waiting for a ready replica.",
                                    labels=["model"])
        replicas = GaugeMetricFamily("ember_gateway_replicas", "Replicas by state.", labels=["model", "state"])
        for dep in self._plane.list():
            waiting.add_metric([dep.name], dep.waiting)
            counts = dep.state_counts()
            for state in ReplicaState:
                replicas.add_metric([dep.name, str(state)], counts[str(state)])
        yield waiting
        yield replicas


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, plane: ControlPlane | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("ember_gateway_requests", "Requests answered, by model, endpoint and HTTP status.",
                                ["model", "endpoint", "status"], registry=self.registry)
        self.upstream_latency = Histogram(
            "ember_gateway_upstream_latency_seconds", "From forwarding a request to the replica's response headers "
            "(the time to first token of a stream).", ["model"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.request_duration = Histogram(
            "ember_gateway_request_duration_seconds", "From receiving a request to the last byte of its response.",
            ["model"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.upstream_retries = Counter("ember_gateway_upstream_retries", "Requests sent to another replica after "
                                        "one answered 503 or could not be reached.", ["model"],
                                        registry=self.registry)
        if plane is not None:
            self.registry.register(_PlaneCollector(plane))

    def count(self, model: str, endpoint: str, status: int) -> None:
        self.requests.labels(model, endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
