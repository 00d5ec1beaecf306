"""The cold-start cache of quantized weights: a second start with the same weights and quantization skips loading
full precision and quantizing, and generates exactly what the first did."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_platform import LLM, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
PROMPT = "class Queue:\n    def __init__(self):\n"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", str(tmp_path / "quantized"))
    return tmp_path / "quantized"


def generate(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].token_ids


def test_second_start_restores_the_quantized_weights_and_matches(cache_dir: Path) -> None:
    first = LLM(EXAMPLE, quantization="int8")
    assert not first.engine.quantized_from_cache and first.engine.timings["quantize"] > 0
    [entry] = cache_dir.glob("*/model.safetensors")
    second = LLM(EXAMPLE, quantization="int8")
    assert second.engine.quantized_from_cache and second.engine.timings["quantize"] == 0.0
    assert generate(second) == generate(first)
    # Other options are another entry; the weights are keyed too (same file count after a third identical start).
    LLM(EXAMPLE, quantization="int8", quantization_options={"skip": ["lm_head", "down_proj"]})
    assert len(list(cache_dir.glob("*/model.safetensors"))) == 2
    assert entry.is_file()


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(cache_dir: Path) -> None:
    reference = generate(LLM(EXAMPLE, quantization="int8"))
    [entry] = cache_dir.glob("*/model.safetensors")
    entry.write_bytes(entry.read_bytes()[:1000])  # truncated
    again = LLM(EXAMPLE, quantization="int8")
    assert not again.engine.quantized_from_cache and generate(again) == reference
    assert LLM(EXAMPLE, quantization="int8").engine.quantized_from_cache  # rewritten by the start that missed


def test_the_cache_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_QUANTIZED_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    LLM(EXAMPLE, quantization="int8")
    assert not LLM(EXAMPLE, quantization="int8").engine.quantized_from_cache
    assert not (tmp_path / ".cache" / "ember" / "quantized").exists()
