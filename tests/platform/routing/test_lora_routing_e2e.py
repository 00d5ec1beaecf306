"""LoRA-aware routing end to end: a real `redis-server`, two gateways (`ember serve --redis-url`) and two replica
processes of the example model with two PEFT adapters, the official `openai` client.

The topology of bench/bench_routing.py (and test_routing_e2e.py; both start it with conftest.py's `start_topology`):
gateway A runs the replicas, which publish the adapters resident in their engines to Redis; gateway B runs none and
routes through the shared tables alone. With each adapter resident on one replica only, every request for
`MODEL:ADAPTER` through either gateway lands on that replica.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
MODEL = "tiny-llama"
ADAPTERS = ("sql", "docs")


def make_adapters(root: Path) -> Path:
    """Two PEFT adapters of the example model, made at test time (random init, so that each changes the output)."""
    import peft
    import torch
    import transformers

    for seed, name in enumerate(ADAPTERS):
        base = transformers.AutoModelForCausalLM.from_pretrained(EXAMPLE / "weights")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        model.save_pretrained(root / name)
    return root


@pytest.fixture
def topology(start_topology: Callable[..., Any], tmp_path: Path) -> Any:
    """Gateways A (2 replicas) and B (none), each package with the adapters as its `[[lora]]` entries."""
    adapters = make_adapters(tmp_path / "adapters")
    lora_entries = "".join(f'\n[[lora]]\nname = "{name}"\npath = "adapters/{name}"\n' for name in ADAPTERS)
    return start_topology(replicas=2, adapters=adapters, manifest_extra=lora_entries)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # transformers, inside peft
def test_adapter_requests_land_on_the_replica_that_holds_the_adapter(topology: Any,
                                                                     wait_until: Callable[..., Any]) -> None:
    a, b = topology.gateways
    urls = topology.routed()
    first, second = sorted(urls)
    home = {"sql": first, "docs": second}

    # Make each adapter resident on one replica only, by asking that replica directly.
    for adapter, rid in home.items():
        reply = httpx.post(f"{urls[rid]}/v1/completions", json={"model": f"{MODEL}:{adapter}", "prompt": "x = 1",
                                                                 "max_tokens": 1},
                           headers=topology.replica_headers, timeout=60)
        assert reply.status_code == 200, reply.text

    def adapters() -> dict[str, frozenset[str]]:
        return {v.replica_id: v.record.adapters for v in topology.tables.snapshot(MODEL)}

    wait_until(lambda: adapters() == {first: {"sql"}, second: {"docs"}}, 10, "the replicas to publish their adapters")

    # Through both gateways, with prompts no replica holds: each request lands where its adapter is resident (the
    # other replica would have to load it first, which the lora scorer prices at its load time).
    before = topology.served_by(urls)
    sent = dict.fromkeys(urls, 0)
    for i in range(12):
        adapter = ADAPTERS[i % 2]
        gateway = (a, b)[(i // 2) % 2]
        reply = gateway.client().completions.create(model=f"{MODEL}:{adapter}", prompt=f"def handler_{i}(request):",
                                                    max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        sent[home[adapter]] += 1
    assert {rid: n - before[rid] for rid, n in topology.served_by(urls).items()} == sent
    assert adapters() == {first: {"sql"}, second: {"docs"}}  # neither replica had to load the other's adapter
