"""AsyncEngine: one step loop in a thread, many asyncio streams, aborts on early exit."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ember_platform import AsyncEngine, SamplingParams
from ember_platform.engine.engine import LLMEngine

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(LLMEngine(EXAMPLE))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt, params=GREEDY) -> tuple[list[int], str, str | None]:
    tokens, text, reason = [], "", None
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
        text += out.new_text
        reason = out.finish_reason
    return tokens, text, reason


def test_streams_concurrently_with_results_equal_to_running_alone(engine: AsyncEngine) -> None:
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]

    async def main():
        alone = [await collect(engine, p) for p in prompts[:2]]
        together = await asyncio.gather(*(collect(engine, p) for p in prompts))
        return alone, together

    alone, together = asyncio.run(main())
    assert together[:2] == alone
    assert all(len(tokens) == 20 and reason == "length" for tokens, _, reason in together)
    assert together[0][1] == engine.tokenizer.decode(together[0][0])


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def main():
        stream = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(main())
    kv = engine.engine.kv
    deadline = time.monotonic() + 5
    while kv.num_free_blocks != kv.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kv.num_free_blocks == kv.num_blocks and not engine.engine.has_unfinished()


def test_invalid_request_raises_in_the_caller(engine: AsyncEngine) -> None:
    async def main():
        async for _ in engine.generate([1] * 5000, GREEDY):
            pass

    with pytest.raises(ValueError, match="prompt: 5000 tokens"):
        asyncio.run(main())
