"""The built-in routing scorers are an ordinary plugin: found through the entry point, light, lazy to load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ember.plugins import PluginHost
from ember_platform.routing import ReplicaLoad, ReplicaRecord, ReplicaView, RouteRequest, Score, Scorer


def view(cached: int = 0, *, free: int = 100, total: int = 100, adapters: frozenset[str] = frozenset(),
         block_size: int = 16) -> ReplicaView:
    load = ReplicaLoad(num_free_blocks=free, num_total_blocks=total, max_num_seqs=8)
    return ReplicaView(ReplicaRecord("r", "m", "u", block_size=block_size, load=load, adapters=adapters), 0, cached)


def test_plugin_module_imports_neither_torch_nor_redis() -> None:
    code = "import sys, ember_plugins.routing; print('torch' in sys.modules or 'redis' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_scorers_are_discovered_through_the_entry_point() -> None:
    scorers = PluginHost().techniques.of_kind("routing_scorer")
    assert {name: t.plugin for name, t in scorers.items() if t.plugin == "routing"} == {
        "prefix": "routing", "load": "routing", "lora": "routing"}
    assert all(isinstance(scorers[name].impl, str) for name in ("prefix", "load", "lora"))  # imported on use
    assert all(isinstance(scorers[name].load()(), Scorer) for name in ("prefix", "load", "lora"))
    assert "routing" not in {p.name for p in PluginHost(disabled={"routing"}).plugins()}


def test_prefix_cost_is_the_uncached_prompt(scorer_host: PluginHost) -> None:
    prefix = scorer_host.techniques.get("routing_scorer", "prefix").load()()
    request = RouteRequest("m", (b"h" * 16,) * 4, num_prompt_tokens=70)
    assert prefix.score(request, [view(0), view(3), view(4)]) == [Score(70.0), Score(22.0), Score(6.0)]
    # Unknown prompt length: the hashed blocks are all the router knows of it.
    assert prefix.score(RouteRequest("m", (b"h" * 16,) * 4), [view(1)]) == [Score(48.0)]


def test_load_cost_rates_and_kv_shortage(scorer_host: PluginHost) -> None:
    load = scorer_host.techniques.get("routing_scorer", "load").load()(running_cost=10, queued_cost=1000,
                                                                      pending_cost=0.5)
    request = RouteRequest("m", (b"h" * 16,) * 4, num_prompt_tokens=64)
    plenty, short, silent = load.score(request, [view(0, free=10), view(1, free=1), view(0, free=0, total=0)])
    assert plenty == Score(0.0, per_request=10.0, per_queued=1000.0, per_pending=0.5)
    assert short.cost == (3 - 1) * 16  # three blocks to compute, one free: two blocks' tokens must wait
    assert silent.cost == 0.0  # a replica that reports no KV figures is not penalized
    with pytest.raises(ValueError, match="running_cost, queued_cost and pending_cost must be >= 0"):
        type(load)(running_cost=-1)


def test_lora_cost_is_zero_where_resident(scorer_host: PluginHost) -> None:
    lora = scorer_host.techniques.get("routing_scorer", "lora").load()(load_cost=300)
    replicas = [view(adapters=frozenset({"sql"})), view()]
    assert lora.score(RouteRequest("m", lora="sql"), replicas) == [Score(0.0), Score(300.0)]
    assert lora.score(RouteRequest("m"), replicas) == [Score(), Score()]
