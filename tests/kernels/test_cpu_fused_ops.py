"""The fused CPU ops against the torch formulas they replace: rotary bit-identical; RMSNorm bit-identical given
the same mean of squares; SiLU-and-mul within a bf16 ulp or a few float32 ulps (its exp); inputs left alone;
None/False for inputs they cannot take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember_kernels.cpu import fused_ops
from ember_kernels.cpu.build import native_function
from ember_kernels.cpu.fused_ops import fused_ops_available, rms_norm, rotary_, silu_and_mul

pytestmark = pytest.mark.skipif(not fused_ops_available(), reason="native CPU kernels unavailable")

EPS = 1e-5


# The torch formulas (transformers' LlamaRMSNorm with a fused residual add, GPT-NeoX rotary, SwiGLU).
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       float64_variance: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64_variance: the mean of squares in float64, then rounded to float32, as the kernel does it;
    every other step is the same, so the kernel must then be bit-identical."""
    h = x if residual is None else x + residual
    hf = h.float()
    squares = hf.double().pow(2) if float64_variance else hf.pow(2)
    variance = squares.mean(-1, keepdim=True).float()
    normed = hf * torch.rsqrt(variance + eps)
    return weight * normed.to(h.dtype), h


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd], cos/sin [T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between bf16 values in units in the last place (+0 and -0 are 0 apart)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits + 32768), bits)
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rope_tables(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(tokens, dtype=torch.float32) + 7
    angles = torch.outer(positions, inv_freq)
    emb = torch.cat((angles, angles), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("dim", [64, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int, dim: int, with_residual: bool) -> None:
    x = randn(rows, dim, dtype=dtype, seed=rows + dim, scale=3.0)
    residual = randn(rows, dim, dtype=dtype, seed=1, scale=2.0) if with_residual else None
    weight = (1.0 + 0.3 * randn(dim, dtype=torch.float32, seed=2)).to(dtype)
    originals = [t.clone() for t in (x, weight, residual) if t is not None]
    result = rms_norm(x, weight, EPS, residual)
    assert result is not None
    out, stream = result
    want_out, want_stream = rms_norm_reference(x, weight, EPS, residual)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(stream, want_stream)
    if with_residual:
        assert stream.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # type: ignore[union-attr]
    else:
        assert stream is x
    if dtype == torch.float32:
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    else:
        # Not 1: torch's float32 sum of squares can differ from the kernel's by an ulp, which can move the
        # normed value across a bf16 tie (1 ulp), and the weight product can make that 2 at a binade edge.
        assert ulps_apart(out, want_out) <= 2
    assert torch.equal(out, rms_norm_reference(x, weight, EPS, residual, float64_variance=True)[0])
    for before, after in zip(originals, [t for t in (x, weight, residual) if t is not None], strict=True):
        assert torch.equal(before, after)


def test_rms_norm_residual_out_may_be_the_residual() -> None:
    """The C contract the wrapper does not use: residual_out == residual, updated in place."""
    fn = native_function("ember_rms_norm", fused_ops._RMS_NORM_ARGS)
    x, residual = randn(3, 64, dtype=torch.bfloat16, seed=6), randn(3, 64, dtype=torch.bfloat16, seed=7)
    weight = randn(64, dtype=torch.bfloat16, seed=8)
    want_out, want_stream = rms_norm_reference(x, weight, EPS, residual, float64_variance=True)
    out = torch.empty_like(x)
    assert fn(x.data_ptr(), residual.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), 3, 64,
              EPS, 1, 1) == 0
    assert torch.equal(out, want_out) and torch.equal(residual, want_stream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_same_on_one_thread(dtype: torch.dtype) -> None:
    x, residual = randn(300, 1024, dtype=dtype, seed=3), randn(300, 1024, dtype=dtype, seed=4)
    weight = randn(1024, dtype=dtype, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = rms_norm(x, weight, EPS, residual)
    finally:
        torch.set_num_threads(threads)
    both = rms_norm(x, weight, EPS, residual)
    assert single is not None and both is not None
    assert torch.equal(single[0], both[0]) and torch.equal(single[1], both[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 257])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (16, 4)])
@pytest.mark.parametrize("head_dim", [64, 12])
def test_rotary_on_a_qkv_slice_is_bit_identical(dtype: torch.dtype, tokens: int, q_heads: int, kv_heads: int,
                                                head_dim: int) -> None:
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, seed=tokens * head_dim, scale=2.0)
    original = qkv.clone()
    cos, sin = rope_tables(tokens, head_dim, dtype)
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    want_q, want_k = rotary_reference(q.clone(), cos, sin), rotary_reference(k.clone(), cos, sin)
    assert rotary_(q, cos, sin) and rotary_(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 300])
@pytest.mark.parametrize("inter", [2816, 13])  # 13: a tail after the 8-wide vectors
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    x = randn(rows, 2 * inter, dtype=dtype, seed=rows, scale=4.0)
    original = x.clone()
    out = silu_and_mul(x)
    want = silu_and_mul_reference(x)
    assert out is not None and out.dtype == dtype and out.shape == (rows, inter)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-7)
    else:
        assert ulps_apart(out, want) <= 1
    assert torch.equal(x, original)


def test_silu_and_mul_keeps_leading_dims_and_extremes() -> None:
    x = torch.tensor([[[-200.0, -1.0, 0.0, 90.0, 2.0, 3.0, -4.0, 5.0]]])
    out = silu_and_mul(x)
    assert out is not None and out.shape == (1, 1, 4)
    torch.testing.assert_close(out, silu_and_mul_reference(x), rtol=1e-6, atol=0.0)


def test_bf16_nan_rounds_like_torch() -> None:
    x = torch.tensor([[float("nan"), 1.0]], dtype=torch.bfloat16)
    out = silu_and_mul(x)
    assert out is not None and out.view(torch.int16).item() & 0x7FFF == 0x7FC0


def test_unsupported_inputs_are_refused_untouched() -> None:
    x16 = torch.randn(2, 64, dtype=torch.float16)
    assert rms_norm(x16, torch.ones(64, dtype=torch.float16), EPS) is None
    x = torch.randn(2, 64)
    assert rms_norm(x, torch.ones(64, dtype=torch.bfloat16), EPS) is None  # dtypes differ
    assert rms_norm(x, torch.ones(64), EPS, x.bfloat16()) is None
    assert rms_norm(x.t().contiguous().t(), torch.ones(64), EPS) is None  # not contiguous
    assert rms_norm(x, torch.ones(32), EPS) is None  # weight does not fit
    assert rms_norm(x, torch.ones(64), EPS, torch.randn(3, 64)) is None

    assert silu_and_mul(x16) is None
    assert silu_and_mul(torch.randn(4, 8)[:, :6]) is None  # not contiguous
    assert silu_and_mul(torch.randn(4, 7)) is None  # odd width

    cos, sin = rope_tables(3, 8, torch.float32)
    q = torch.randn(3, 2, 8)
    before = q.clone()
    assert not rotary_(q.half(), cos.half(), sin.half())
    assert not rotary_(q, cos.bfloat16(), sin)  # dtypes differ
    assert not rotary_(q.transpose(0, 1), cos, sin)  # heads not contiguous
    assert not rotary_(q, cos[:2], sin[:2])  # tables do not fit
    overlapping = torch.randn(40).as_strided((3, 2, 8), (8, 8, 1))  # token stride 8 < 2 heads * 8
    assert not rotary_(overlapping, cos, sin)
    odd = torch.randn(3, 2, 7)
    odd_before = odd.clone()
    assert not rotary_(odd, torch.randn(3, 7), torch.randn(3, 7))  # odd head_dim
    assert torch.equal(q, before) and torch.equal(odd, odd_before)
