"""The native drafters' packed int8 linear (draft_ops.h) against the matrix it packs: tails of N (a padded last
block), of K (past the unrolled fours) and of the rows (past groups of four), one thread and two. On a CPU with
AVX512-VNNI it is W8A8: its inputs are rounded to int8 per row, and the reference rounds them alike."""

from __future__ import annotations

import pytest
import torch

from ember_kernels.cpu.draft_weights import (
    PACK,
    pack_int8,
    packed_int8_activation_bits,
    packed_int8_linear,
    round_rows_int8,
    unpack_int8,
)
from ember_kernels.cpu.eagle3_draft import eagle3_draft_available

pytestmark = pytest.mark.skipif(not eagle3_draft_available(), reason="native CPU kernels unavailable")


def test_packing_keeps_every_row_and_rounds_each_to_its_own_scale() -> None:
    weight = torch.randn(37, 19, generator=torch.Generator().manual_seed(0))
    packed, scales = pack_int8(weight)
    assert packed.shape == (3, 19, PACK) and scales.shape == (3 * PACK,)
    assert bool((scales[37:] == 0).all()) and bool((packed[2, :, 37 - 2 * PACK:] == 0).all())
    restored = unpack_int8(packed, scales, 37)
    # round to nearest on a grid of max |w| / 127 per row: at most half a step off
    assert bool(((restored - weight).abs() <= scales[:37, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(1024, 256), (37, 19), (344, 257), (16, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_unpacked_matrix(rows: int, out_features: int, in_features: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed, scales = pack_int8(weight)
    out = packed_int8_linear(x, packed, scales, out_features, num_threads=threads)
    assert out is not None and out.shape == (rows, out_features)
    reference = as_computed(x).double() @ unpack_int8(packed, scales, out_features).double().T
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)


def as_computed(x: torch.Tensor) -> torch.Tensor:
    """The inputs as this build's kernel computes with them."""
    return round_rows_int8(x) if packed_int8_activation_bits() == 8 else x


def test_w8a8_rounds_each_row_on_its_own_scale() -> None:
    # A row of zeros and a row with an outlier next to ordinary rows: each row's error stays within half a step
    # of its own grid (max |x| / 127), so one row's outlier never coarsens another's.
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    x[1] = 0.0
    x[2, 17] = 80.0
    rounded = round_rows_int8(x)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((rounded - x).abs() <= step / 2 + 1e-6).all()) and bool((rounded[1] == 0).all())
    weight = torch.randn(40, 300, generator=torch.Generator().manual_seed(4))
    packed, scales = pack_int8(weight)
    out = packed_int8_linear(x, packed, scales, 40)
    assert out is not None and bool((out[1] == 0).all())
    reference = as_computed(x).double() @ unpack_int8(packed, scales, 40).double().T
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
    # where the kernel is W8A8, its sums are those of the rounded rows, not of x itself
    if packed_int8_activation_bits() == 8:
        exact = x.double() @ unpack_int8(packed, scales, 40).double().T
        assert not torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4)


def test_work_split_across_threads_gives_the_same_sums() -> None:
    # above the kernel's threshold for waking a second thread (2^20 multiply-adds): blocks split, sums unchanged
    gen = torch.Generator().manual_seed(7)
    weight, x = torch.randn(1376, 512, generator=gen), torch.randn(4, 512, generator=gen)
    packed, scales = pack_int8(weight)
    one = packed_int8_linear(x, packed, scales, 1376, num_threads=1)
    two = packed_int8_linear(x, packed, scales, 1376, num_threads=2)
    assert one is not None and two is not None and torch.equal(one, two)


def test_arguments_that_do_not_fit_are_refused() -> None:
    packed, scales = pack_int8(torch.randn(20, 8))
    with pytest.raises(ValueError, match="do not fit"):
        packed_int8_linear(torch.randn(2, 9), packed, scales, 20)
    with pytest.raises(ValueError, match="do not fit"):
        packed_int8_linear(torch.randn(2, 8), packed, scales, 33)
