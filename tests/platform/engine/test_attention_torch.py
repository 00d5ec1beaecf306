"""The "torch" paged-attention backend against a plain dense reference, request by request."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from ember.plugins import PluginHost
from ember_kernels.cpu import native_library_error, paged_attention_available
from ember_platform.engine.attention import AttentionBackend, AttentionMetadata, kv_cache_block_shape
from ember_platform.engine.kernel_ops import KernelOps
from ember_plugins.attention.torch_paged import TorchPagedAttention

BLOCK_SIZE = 4
HEAD_DIM = 16


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        window: int | None) -> torch.Tensor:
    """Dense float64 attention of one request: q [q_len, H, D] over its whole context [S, Hkv, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [S, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


@dataclass
class Step:
    """One engine step's inputs plus what the reference needs: each request's full context."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: tuple[torch.Tensor, torch.Tensor]
    meta: AttentionMetadata
    contexts: list[tuple[torch.Tensor, torch.Tensor]]


def make_step(query_lens: list[int], seq_lens: list[int], num_heads: int = 8, num_kv_heads: int = 2,
              dtype: torch.dtype = torch.float32, seed: int = 0, head_dim: int = HEAD_DIM,
              block_size: int = BLOCK_SIZE) -> Step:
    """Random contexts in a cache whose blocks are shuffled and interleaved between requests.

    Earlier context is already in the cache; this step's k/v are not (the backend writes them).
    Every other slot holds finite garbage, so anything the backend fails to mask shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, *kv_cache_block_shape(block_size, num_kv_heads, head_dim))
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables, contexts, qs, ks, vs = [], [], [], [], []
    for q_len, seq_len, n in zip(query_lens, seq_lens, blocks_needed, strict=True):
        table, ids = ids[:n], ids[n:]
        tables.append(table)
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len - q_len):
            k_cache[table[pos // block_size], :, pos % block_size] = keys[pos]
            v_cache[table[pos // block_size], :, pos % block_size] = values[pos]
        contexts.append((keys, values))
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(keys[seq_len - q_len:])
        vs.append(values[seq_len - q_len:])
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    return Step(torch.cat(qs), torch.cat(ks), torch.cat(vs), (k_cache, v_cache), meta, contexts)


def check(step: Step, backend: TorchPagedAttention, atol: float) -> float:
    """Run the backend; compare every request's output and the cache writes. Returns the max error."""
    k_cache, v_cache = step.kv_cache
    block_size, head_dim = k_cache.shape[2], k_cache.shape[3]
    scale = head_dim**-0.5
    out = backend.forward(step.q, step.k, step.v, step.kv_cache, step.meta, scale)
    assert out.shape == step.q.shape and out.dtype == step.q.dtype
    blocks, offsets = step.meta.slot_mapping // block_size, step.meta.slot_mapping % block_size
    torch.testing.assert_close(k_cache[blocks, :, offsets], step.k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache[blocks, :, offsets], step.v, rtol=0, atol=0)
    worst, start = 0.0, 0
    for q_len, (keys, values) in zip(step.meta.query_lens, step.contexts, strict=True):
        expected = reference_attention(step.q[start:start + q_len], keys, values, scale, backend.sliding_window)
        got = out[start:start + q_len].double()
        worst = max(worst, (got - expected).abs().max().item())
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)
        start += q_len
    return worst


CASES = {
    # name: (query_lens, seq_lens)
    "decode_only": ([1, 1, 1, 1, 1], [1, 7, 16, 33, 70]),
    "fresh_prefills": ([20, 37, 5], [20, 37, 5]),
    "prefill_chunks_with_context": ([24, 10, 17], [60, 30, 17 + 40]),
    "mixed": ([1, 24, 1, 4, 3, 1], [9, 50, 1, 21, 3, 64]),
    "uniform_speculative": ([3, 3, 3], [3, 18, 41]),
}


@pytest.fixture(params=[False, True], ids=["torch-ops", "native"])
def native(request: pytest.FixtureRequest) -> bool:
    """Run the short-query path both ways: torch ops, and the native CPU kernel where it builds."""
    if request.param and not paged_attention_available(torch.float32):
        pytest.skip(f"native CPU kernel unavailable: {native_library_error()}")
    return request.param


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 8])
def test_matches_dense_reference(case: str, window: int | None, native: bool) -> None:
    query_lens, seq_lens = CASES[case]
    check(make_step(query_lens, seq_lens), TorchPagedAttention(sliding_window=window, native=native), atol=2e-5)


@pytest.mark.parametrize("case", ["decode_only", "mixed"])
def test_many_small_chunks_and_requests_shorter_than_a_chunk(case: str) -> None:
    # 2 blocks per chunk: a request's blocks span several chunks, and chunks span requests.
    query_lens, seq_lens = CASES[case]
    backend = TorchPagedAttention(chunk_elements=2 * 2 * BLOCK_SIZE * HEAD_DIM, native=False)  # 2 blocks, 2 heads
    check(make_step(query_lens, seq_lens, seed=1), backend, atol=2e-5)


@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_multi_query_and_multi_head(num_kv_heads: int, native: bool) -> None:
    query_lens, seq_lens = CASES["mixed"]
    check(make_step(query_lens, seq_lens, num_kv_heads=num_kv_heads, seed=2), TorchPagedAttention(native=native),
          atol=2e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_every_request_through_the_batched_path(native: bool, window: int | None) -> None:
    # With a high threshold prefill chunks take the batched path too (padding queries in between).
    query_lens, seq_lens = CASES["prefill_chunks_with_context"]
    backend = TorchPagedAttention(max_batched_query_len=64, chunk_elements=3 * 2 * BLOCK_SIZE * HEAD_DIM,
                                  native=native, sliding_window=window)
    check(make_step(query_lens, seq_lens, seed=3), backend, atol=2e-5)


@pytest.mark.parametrize(("head_dim", "block_size"), [(12, 4), (8, 3), (64, 16), (128, 16)],
                         ids=["portable-loops", "odd-block", "llama-64", "llama-128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_head_and_block_sizes(head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    # Head sizes that are a multiple of 8 take the kernel's AVX2 item (where the CPU has it), others the
    # portable loops; blocks of 3 and 16 keys exercise partial groups of four keys and whole vectors.
    if not paged_attention_available(dtype):
        pytest.skip(f"native CPU kernel unavailable: {native_library_error()}")
    query_lens, seq_lens = [1, 1, 3, 1, 4], [1, 45, 37, 200, 9]
    step = make_step(query_lens, seq_lens, dtype=dtype, seed=5, head_dim=head_dim, block_size=block_size)
    for window in (None, 7):
        check(step, TorchPagedAttention(native=True, sliding_window=window),
              atol=2e-5 if dtype == torch.float32 else 2e-2)


def test_native_output_does_not_depend_on_the_batch() -> None:
    # Batched decode and speculative verification must not change a request's attention: the same
    # request alone and among others gives bit-identical output.
    if not paged_attention_available(torch.float32):
        pytest.skip(f"native CPU kernel unavailable: {native_library_error()}")
    query_lens, seq_lens = [1, 3, 1, 2], [70, 41, 5, 130]
    batch = make_step(query_lens, seq_lens, seed=6, head_dim=64, block_size=16)
    backend = TorchPagedAttention(native=True)
    together = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.meta, 0.125)
    start = 0
    for i, q_len in enumerate(query_lens):
        tokens = slice(start, start + q_len)
        meta = AttentionMetadata.build([q_len], [seq_lens[i]], [batch.meta.block_tables[i].tolist()], 16)
        alone = backend.forward(batch.q[tokens], batch.k[tokens], batch.v[tokens], batch.kv_cache, meta, 0.125)
        torch.testing.assert_close(alone, together[tokens], rtol=0, atol=0)
        start += q_len


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [2, 2, 2, 2]], ids=["decode", "two-token-runs"])
def test_native_bf16_strided_queries_equal_the_float32_path_rounded(query_lens: list[int]) -> None:
    # The kernel takes a model's bf16 q as a slice of its fused qkv output and writes bf16 itself; the
    # result must be exactly widening q first and rounding the float32 output after.
    if not paged_attention_available(torch.bfloat16):
        pytest.skip(f"native CPU kernel unavailable: {native_library_error()}")
    step = make_step(query_lens, [70, 41, 5, 130], dtype=torch.bfloat16, seed=7, head_dim=64, block_size=16)
    num_tokens, num_heads, head_dim = step.q.shape
    wide = torch.cat([step.q.flatten(1), torch.randn(num_tokens, 24).bfloat16()], dim=1)
    q_strided = wide[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    backend = TorchPagedAttention(native=True)
    out = backend.forward(q_strided, step.k, step.v, step.kv_cache, step.meta, 0.125)
    via_float = backend.forward(step.q.float(), step.k, step.v, step.kv_cache, step.meta, 0.125)
    assert out.dtype == torch.bfloat16 and via_float.dtype == torch.float32
    assert torch.equal(out, via_float.to(torch.bfloat16))


@pytest.mark.parametrize("case", ["decode_only", "mixed"])
def test_bfloat16_accumulates_in_float32(case: str, native: bool) -> None:
    query_lens, seq_lens = CASES[case]
    step = make_step(query_lens, seq_lens, dtype=torch.bfloat16, seed=4)
    err = check(step, TorchPagedAttention(native=native), atol=2e-2)
    assert err < 2e-2


def test_layers_share_the_step_plan() -> None:
    step = make_step(*CASES["mixed"])
    backend = TorchPagedAttention(ops=KernelOps.from_plugins(PluginHost()))  # the engine's table
    scale = HEAD_DIM**-0.5
    first = backend.forward(step.q, step.k, step.v, step.kv_cache, step.meta, scale)
    made = dict(step.meta.scratch)  # the plan, and write_kv's cache rows where it has no native copy
    assert len(made) == (1 if paged_attention_available(torch.float32) else 2)
    again = backend.forward(step.q, step.k, step.v, step.kv_cache, step.meta, scale)
    assert step.meta.scratch.keys() == made.keys()
    assert all(step.meta.scratch[key] is value for key, value in made.items())  # reused, not rebuilt
    torch.testing.assert_close(first, again, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
def test_write_kv_stores_strided_slices_at_their_slots(dtype: torch.dtype, native: bool) -> None:
    if native and not paged_attention_available(torch.float32):
        pytest.skip(f"native CPU kernels unavailable: {native_library_error()}")
    # The engine's table (the kernels plugin's copy first), or the torch reference, as on a machine without a compiler.
    ops = KernelOps.from_plugins(PluginHost()) if native else KernelOps.reference()
    assert ops.describe()["write_kv"] == ("kernels-cpu:write_kv > torch" if native else "torch")

    def store(*args: object) -> None:
        assert ops.write_kv(*args) is True

    num_kv_heads, head_dim, num_blocks = 2, 8, 6
    shape = (num_blocks, *kv_cache_block_shape(BLOCK_SIZE, num_kv_heads, head_dim))
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    qkv = torch.randn(5, 3 * num_kv_heads * head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    width = num_kv_heads * head_dim  # k and v are column slices of a fused projection, as models pass them
    k, v = qkv[:, width:2 * width].view(5, num_kv_heads, head_dim), qkv[:, 2 * width:].view(5, num_kv_heads, head_dim)
    slots = [3, 9, 10, 22, 0]
    store((k_cache, v_cache), k, v, torch.tensor(slots), {})
    expected_k, expected_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    for t, slot in enumerate(slots):
        expected_k[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE] = k[t]
        expected_v[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE] = v[t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(IndexError):
        store((k_cache, v_cache), k[:2], v[:2], torch.tensor([1, num_blocks * BLOCK_SIZE]), {})
    if native:  # the native copy checks every slot before writing any (index_copy_ may stop half-way)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_backend_satisfies_the_protocol() -> None:
    backend = TorchPagedAttention(sliding_window=4)
    assert isinstance(backend, AttentionBackend)
    assert backend.name == "torch"


def test_metadata_build_and_validation() -> None:
    meta = AttentionMetadata.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    # request 0: positions 3, 4 -> block 7 offset 3, block 2 offset 0; request 1: position 2 -> block 4 offset 2
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]]
    assert meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len, meta.decode_only) == (2, 5, False)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata.build([4], [3], [[0]], block_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


def test_invalid_sliding_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        TorchPagedAttention(sliding_window=0)
