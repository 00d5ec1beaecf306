"""The attention-backend contract: KV cache specs (layout, int8 / fp8 dtypes with scales, block sizes) that the
worker allocates and sizes from, the per-step metadata builder, `[kernels] options` reaching the backend,
`[runtime] kv_cache_dtype`, and a third-party backend with its own layout (README's "ember-nhd-attention", installed
for real) that the engine runs end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ember.errors import ManifestError
from ember_platform import LLM, SamplingParams
from ember_platform.engine.attention import (
    AttentionLayerSpec,
    AttentionMetadata,
    check_backend_settings,
    hnd_kv_cache_spec,
)
from ember_plugins.attention.torch_paged import TorchPagedAttention, quantize_kv

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-llama"
LAYER = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_dim=32, scale=32**-0.5)
BLOCK = 4
# Greedy output and per-token logprobs of a quantized cache against the model-dtype cache (tiny-llama, float32).
LOGPROB_ATOL = {"int8": 0.06, "fp8": 0.25}  # measured: 0.036 and 0.14
# Attention output of a quantized cache against the model-dtype one, for N(0, 1) keys and values.
OUTPUT_ATOL = {"int8": 0.03, "fp8": 0.15}  # measured: 0.016 and 0.12


def layer_caches(backend: Any, num_blocks: int) -> tuple[torch.Tensor, ...]:
    return backend.kv_cache_spec(BLOCK).allocate(num_blocks, "cpu")


def run_steps(backend: Any, steps: list[tuple[list[int], list[int]]], tables: list[list[int]],
              seed: int = 0, layer: AttentionLayerSpec = LAYER) -> list[torch.Tensor]:
    """Run a sequence of steps (query_lens, seq_lens) through one backend from empty caches of its own spec, its
    builder planning each step as the runner does; its outputs."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = layer_caches(backend, 64)
    builder = backend.metadata_builder(BLOCK, torch.device("cpu"))
    outs = []
    for query_lens, seq_lens in steps:
        n = sum(query_lens)
        q = torch.randn(n, layer.num_heads, layer.head_dim, generator=gen)
        k = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen)
        v = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=gen)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
        if builder is not None:
            builder.build(meta)
        outs.append(backend.forward(q, k, v, kv_cache, meta, layer.scale))
    return outs


# Two requests: a prefill in two chunks (SDPA path) next to short runs, then decode steps (batched path).
STEPS = [([12, 3], [12, 3]), ([10, 2], [22, 5]), ([1, 1], [23, 6]), ([1, 1], [24, 7]), ([3, 1], [27, 8])]
TABLES = [[5, 9, 1, 30, 2, 7, 11], [40, 3]]


def test_kv_cache_spec_declares_layout_dtypes_and_scales() -> None:
    full = hnd_kv_cache_spec(LAYER, 16)
    assert full.layout == "HND" and not full.quantized
    assert full.tensors == (((2, 16, 32), torch.float32),) * 2
    assert full.bytes_per_block == 2 * 2 * 16 * 32 * 4
    int8 = TorchPagedAttention(layer=LAYER, kv_cache_dtype="int8").kv_cache_spec(16)
    assert [dtype for _, dtype in int8.tensors] == [torch.int8, torch.int8, torch.float32, torch.float32]
    assert int8.bytes_per_block == 2 * 2 * 16 * 32 + 2 * 2 * 16 * 4  # int8 K/V plus a float32 scale per token/head
    caches = int8.allocate(3, "cpu")
    assert [tuple(t.shape) for t in caches] == [(3, 2, 16, 32)] * 2 + [(3, 2, 16)] * 2
    assert TorchPagedAttention.kv_cache_dtypes == ("auto", "int8", "fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int4': the torch backend supports 'auto', 'int8', 'fp8'"):
        TorchPagedAttention(layer=LAYER, kv_cache_dtype="int4")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantize_round_trip(dtype: torch.dtype) -> None:
    x = torch.randn(50, 2, 32) * torch.logspace(-3, 2, 50)[:, None, None]  # magnitudes over five decades
    q, scale = quantize_kv(x, dtype)
    assert q.dtype == dtype and scale.shape == (50, 2)
    back = q.float() * scale[..., None]
    err = (back - x).abs() / x.abs().amax(-1, keepdim=True)  # relative to each token/head's largest value
    assert err.max() <= (0.5 / 127 + 1e-6 if dtype == torch.int8 else 1 / 16)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("native", [False, None])
def test_quantized_cache_matches_full_precision(kv_cache_dtype: str, native: bool | None) -> None:
    # The same steps through a model-dtype cache and a quantized one: writes quantize, reads dequantize, both
    # attention paths (SDPA for the long chunks, batched for the short runs) stay close to full precision.
    full = run_steps(TorchPagedAttention(layer=LAYER, native=native), STEPS, TABLES)
    quant = run_steps(TorchPagedAttention(layer=LAYER, kv_cache_dtype=kv_cache_dtype, native=native), STEPS, TABLES)
    worst = max((a - b).abs().max().item() for a, b in zip(full, quant, strict=True))
    assert 0 < worst < OUTPUT_ATOL[kv_cache_dtype]


def test_quantized_cache_is_stored_quantized() -> None:
    backend = TorchPagedAttention(layer=LAYER, kv_cache_dtype="int8")
    kv_cache = layer_caches(backend, 8)
    k = torch.randn(3, 2, 32)
    v = torch.randn(3, 2, 32)
    meta = AttentionMetadata.build([3], [3], [[6]], BLOCK)
    backend.forward(torch.randn(3, 8, 32), k, v, kv_cache, meta, LAYER.scale)
    k_cache, v_cache, k_scale, v_scale = kv_cache
    assert k_cache.dtype == torch.int8 and int(k_cache[6, :, :3].abs().max()) == 127  # each row's max hits 127
    torch.testing.assert_close(k_cache[6, :, :3].float() * k_scale[6, :, :3, None], k.transpose(0, 1),
                               atol=k.abs().max().item() / 254 + 1e-6, rtol=0)
    torch.testing.assert_close(v_cache[6, :, :3].float() * v_scale[6, :, :3, None], v.transpose(0, 1),
                               atol=v.abs().max().item() / 254 + 1e-6, rtol=0)
    assert k_cache[6, :, 3:].abs().sum() == 0 and k_scale[:6].abs().sum() == 0  # nothing else written


def test_metadata_builder_plans_once_per_step_into_reused_buffers() -> None:
    backend = TorchPagedAttention(layer=LAYER, native=False)
    builder = backend.metadata_builder(BLOCK, torch.device("cpu"))
    key = backend.plan_key(BLOCK)
    plans = []
    for query_lens, seq_lens in [([1, 1, 1], [5, 9, 2]), ([1, 1, 1], [6, 10, 3])]:
        meta = AttentionMetadata.build(query_lens, seq_lens, [[1, 2, 3], [4, 5, 6], [7]], BLOCK)
        builder.build(meta)
        plans.append(meta.scratch[key])
        fresh = backend.make_plan(meta, BLOCK, torch.device("cpu"), native=False)  # what forward would build
        for name in ("q_pos", "blocks", "owner", "hidden"):
            torch.testing.assert_close(getattr(plans[-1].short, name), getattr(fresh.short, name))
    # The second step's q_pos and masks live in the same memory as the first's: persistent buffers.
    assert plans[0].short.q_pos.data_ptr() == plans[1].short.q_pos.data_ptr()
    assert plans[0].short.hidden.data_ptr() == plans[1].short.hidden.data_ptr()


def test_engine_allocates_int8_cache_from_the_spec_and_runs_it() -> None:
    # `[runtime] kv_cache_dtype` (here the LLM override): the worker allocates what the backend's spec says, sizes
    # blocks with its bytes (scales included), and greedy text and per-token logprobs stay close to the
    # model-dtype cache's.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = ["def fibonacci(n):\n    ", "The quick brown fox", "import numpy as np\n"]
    full = LLM(EXAMPLE, kv_cache_memory_gb=0.01)
    reference = full.generate(prompts, params)
    for kv_cache_dtype, atol in LOGPROB_ATOL.items():
        llm = LLM(EXAMPLE, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.01)
        caches = llm.engine.executor.kv_caches
        assert [t.dtype for t in caches[0]] == [torch.int8 if kv_cache_dtype == "int8" else torch.float8_e4m3fn] * 2 \
            + [torch.float32] * 2
        # A block of int8 costs a bit over a quarter of float32's: about 3.5x the blocks in the same budget.
        assert caches[0][0].shape[0] > 3 * full.engine.executor.kv_caches[0][0].shape[0]
        out = llm.generate(prompts, params)
        for got, want in zip(out, reference, strict=True):
            assert got.token_ids == want.token_ids, (kv_cache_dtype, got.text, want.text)
            diffs = [abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs, strict=True)]
            assert max(diffs) < atol, (kv_cache_dtype, max(diffs))


def test_kv_cache_dtype_is_refused_where_the_schema_or_backend_lacks_it(use_plugins) -> None:
    with pytest.raises(ManifestError, match=r"kv_cache_dtype"):
        LLM(EXAMPLE, kv_cache_dtype="int4")
    use_plugins("nhd-attention")
    with pytest.raises(ValueError, match=r"\[runtime\] kv_cache_dtype = 'int8': attention backend 'nhd' supports "
                                         r"'auto'$"):
        LLM(EXAMPLE, attention="nhd", kv_cache_dtype="int8")


def test_kv_tiers_refuse_a_quantized_cache() -> None:
    with pytest.raises(ValueError, match=r"not supported yet: KV tiers with a quantized KV cache .* set \[runtime\] "
                                         r"kv_cache_dtype = \"auto\""):
        LLM(EXAMPLE, kv_cache_dtype="int8", kv_tiers={"cpu_gb": 0.01})


def test_kernels_options_reach_the_backend() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = ["def fibonacci(n):\n    ", "Hello"]
    default = LLM(EXAMPLE).generate(prompt, params)
    llm = LLM(EXAMPLE, attention="torch", attention_options={"max_batched_query_len": 1, "native": False,
                                                             "chunk_elements": 4096})
    backend = llm.engine.executor.driver.model.attention_backends[0]
    assert (backend.max_batched_query_len, backend.native, backend.chunk_elements) == (1, False, 4096)
    assert [o.token_ids for o in llm.generate(prompt, params)] == [o.token_ids for o in default]
    with pytest.raises(ValueError, match=r"options.native must be true or false"):
        LLM(EXAMPLE, attention="torch", attention_options={"native": "yes"})


def test_hook_ember_attention_backends(use_plugins) -> None:
    # README.md's "ember-nhd-attention", pip-installed with its entry point: the engine allocates its token-major
    # cache from its spec, calls its builder once per step and its forward once per layer per step, and greedy
    # output equals the torch backend's.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["def fibonacci(n):\n    ", "The quick brown fox", "Once"]
    default = LLM(EXAMPLE).generate(prompts, params)
    use_plugins("nhd-attention")
    import ember_nhd_attention

    llm = LLM(EXAMPLE, attention="nhd")
    assert llm.engine.selections["attention"].name == "nhd"
    k_cache = llm.engine.executor.kv_caches[0][0]
    cfg = llm.engine.hf_config
    assert tuple(k_cache.shape[1:]) == (llm.engine.block_size, cfg["num_key_value_heads"],
                                        cfg["hidden_size"] // cfg["num_attention_heads"])
    before = dict(ember_nhd_attention.CALLS)
    out = llm.generate(prompts, params)
    builds = ember_nhd_attention.CALLS["build"] - before["build"]
    forwards = ember_nhd_attention.CALLS["forward"] - before["forward"]
    assert builds >= params.max_tokens and forwards == builds * cfg["num_hidden_layers"]
    assert [o.token_ids for o in out] == [o.token_ids for o in default]


def test_readme_backend_matches_torch_with_a_sliding_window(use_plugins) -> None:
    # The README plugin's own layout and masks against the built-in backend, window included (tiny-llama has none).
    use_plugins("nhd-attention")
    from ember_nhd_attention import NHDAttention

    layer = AttentionLayerSpec(num_heads=8, num_kv_heads=2, head_dim=32, scale=32**-0.5, sliding_window=5)
    nhd = NHDAttention(layer=layer, ops=None)
    assert nhd.kv_cache_spec(BLOCK).tensors[0][0] == (BLOCK, 2, 32)  # token-major, unlike torch's (2, BLOCK, 32)
    got = run_steps(nhd, STEPS, TABLES, layer=layer)
    want = run_steps(TorchPagedAttention(layer=layer, native=False), STEPS, TABLES, layer=layer)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_backend_settings_are_checked_against_what_the_class_declares() -> None:
    class Sixteen:
        name = "sixteen"
        kv_cache_dtypes = ("auto", "fp8")
        block_sizes = (16, 32)

    check_backend_settings(Sixteen, "fp8", 32)
    with pytest.raises(ValueError, match=r"kv_block_size = 8: attention backend 'sixteen' supports block sizes 16, 32"):
        check_backend_settings(Sixteen, "auto", 8)
    with pytest.raises(ValueError,
                       match=r"kv_cache_dtype = 'int8': attention backend 'sixteen' supports 'auto', 'fp8'$"):
        check_backend_settings(Sixteen, "int8", 16)
    check_backend_settings(TorchPagedAttention, "int8", 1)  # any block size
