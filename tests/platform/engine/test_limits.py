"""Settings the engine refuses at load (a context past the model's, a KV cache smaller than one sequence), and a
prompt it could never schedule: each a clear error naming what to change, where each once came back as an empty
answer with finish_reason "length"."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from ember_platform import LLM, SamplingParams
from ember_platform.engine.limits import model_context
from ember_platform.replica import Replica, create_app

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"  # max_position_embeddings 2048
LONG_PROMPT = "def f(x): return x " * 20  # 142 tokens


def test_a_context_longer_than_the_model_s_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"ember\.toml: runtime\.max_model_len = 4096 is longer than the model's "
                                         r"context \(2048 tokens"):
        LLM(str(EXAMPLE), max_model_len=4096)


def test_a_kv_cache_smaller_than_one_sequence_is_refused_naming_the_keys() -> None:
    with pytest.raises(ValueError, match=r"ember\.toml: the KV cache holds 16 tokens \(1 blocks of 16\), less than "
                                         r"one sequence of runtime\.max_model_len = 2048: raise "
                                         r"runtime\.kv_cache_memory_gb"):
        LLM(str(EXAMPLE), kv_cache_memory_gb=1e-9)


def test_rope_scaling_stretches_the_context() -> None:
    assert model_context({"max_position_embeddings": 4096}) == 4096
    assert model_context({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}) == 131072
    assert model_context({"max_position_embeddings": 131072,  # llama3 states its stretched context itself
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                           "original_max_position_embeddings": 8192}}) == 131072
    assert model_context({}) is None


def test_a_prompt_the_kv_cache_can_never_hold_is_refused_not_answered_empty() -> None:
    llm = LLM(str(EXAMPLE), num_kv_blocks=4)  # an explicit count, as tests and benches set: 64 tokens
    with pytest.raises(ValueError, match="prompt: 142 tokens, but this engine's KV cache holds 64 tokens"):
        llm.generate([LONG_PROMPT], SamplingParams(max_tokens=4))
    [short] = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0))
    assert len(short.token_ids) == 4


def test_through_a_replica_it_is_a_400_naming_the_prompt_and_the_engine_s_real_limit() -> None:
    import torch

    torch.set_num_threads(1)
    replica = Replica(EXAMPLE, {"num_kv_blocks": 4})
    replica.load()

    async def main() -> None:
        headers = {"Authorization": f"Bearer {replica.secret}"} if getattr(replica, "secret", None) else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(replica)), headers=headers,
                                     base_url="http://replica", timeout=60) as http:
            for stream in (False, True):
                bad = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": LONG_PROMPT,
                                                               "max_tokens": 4, "stream": stream})
                assert bad.status_code == 400, bad.text  # at the edge, before a stream starts
                error = bad.json()["error"]
                assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
                assert "maximum context length is 64 tokens" in error["message"], error
            good = await http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2})
            assert good.status_code == 200, good.text

    try:
        asyncio.run(main())
    finally:
        replica.close()
