"""Sleep frees the KV cache and keeps the weights; the next request wakes the engine with identical output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember_platform import LLM, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser("


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_frees_the_cache_and_a_request_wakes_it_with_the_same_output() -> None:
    llm = LLM(EXAMPLE)
    engine = llm.engine
    weights = [p.data_ptr() for p in engine.model.parameters()]
    params = SamplingParams(temperature=0, max_tokens=24)
    before = llm.generate([PROMPT], params)[0].token_ids

    cache_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in engine.executor.kv_caches)
    assert cache_bytes > 64 << 20
    for k, v in engine.executor.kv_caches:  # a used cache: every page resident, and not zero
        k.fill_(1.0)
        v.fill_(1.0)
    rss = resident_bytes()
    engine.sleep()
    assert engine.sleeping and engine.kv.num_free_blocks == engine.kv.num_blocks
    assert rss - resident_bytes() > cache_bytes // 2  # the memory went back to the OS
    engine.sleep()  # idempotent

    after = llm.generate([PROMPT], params)[0].token_ids  # wakes on the request
    assert not engine.sleeping and after == before
    assert llm.generate([PROMPT], params)[0].usage.cached_tokens > 0  # the prefix cache works again

    engine.sleep()
    assert engine.wake() >= 0 and not engine.sleeping
    assert [p.data_ptr() for p in engine.model.parameters()] == weights  # the weights never left


def test_sleep_refuses_while_requests_run() -> None:
    llm = LLM(EXAMPLE)
    engine = llm.engine
    engine.add_request("busy", PROMPT, SamplingParams(max_tokens=8))
    engine.step()
    with pytest.raises(RuntimeError, match="requests in flight"):
        engine.sleep()
    while engine.has_unfinished():
        engine.step()
    engine.sleep()
    assert engine.sleeping
