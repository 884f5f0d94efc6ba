"""The Triton FP4 kernel (MXFP4, NVFP4) against densa.formats.fp4's reference dequantization,
run on the CPU by Triton's interpreter: its indexing, scale decoding (E8M0 0x00 and 0xFF, e4m3
subnormals and NaN) and tensor scales per row; not its speed (untested on a GPU here)."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from densa.formats import fp4
from densa.formats.fp4 import Fp4Scheme

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton or the kernel is imported
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    import densa.kernels.triton.fp4_linear as module

    return module


def _weight(scheme: Fp4Scheme, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    qweight = fp4.pack_fp4(codes)
    if scheme == Fp4Scheme.MXFP4:
        scales = torch.randint(120, 134, (n, k // 32), generator=gen, dtype=torch.uint8)
        scales[0, 0], scales[1, -1] = 0x00, 0x01
        return qweight, scales, None
    scales = torch.randint(0x20, 0x58, (n, k // 16), generator=gen, dtype=torch.uint8)
    scales[0, 0], scales[1, -1] = 0x01, 0x86  # a subnormal, a negative scale
    return qweight, scales, torch.rand(n, generator=gen) + 0.5


def _dense(scheme: Fp4Scheme, qweight: torch.Tensor, scales: torch.Tensor, t: torch.Tensor | None):
    if scheme == Fp4Scheme.MXFP4:
        return fp4.dequantize_mxfp4(qweight, scales)
    assert t is not None
    return fp4.dequantize_nvfp4(qweight, scales, t)


@pytest.mark.parametrize("scheme", [Fp4Scheme.MXFP4, Fp4Scheme.NVFP4], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    ("n", "k", "rows", "dtype"),
    [(48, 96, 1, torch.float32), (70, 64, 5, torch.float32), (64, 128, 3, torch.float16)],
)
def test_triton_fp4_matches_the_reference(
    kernels: ModuleType, scheme: Fp4Scheme, n: int, k: int, rows: int, dtype: torch.dtype
) -> None:
    qweight, scales, t = _weight(scheme, n, k, seed=n + rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = kernels.fp4_linear_triton(x, qweight, scales, t, scheme, bias)
    expected = F.linear(x.double(), _dense(scheme, qweight, scales, t).double(), bias.double())
    assert got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_a_nan_scale_makes_its_rows_nan(kernels: ModuleType) -> None:
    qweight, scales, _ = _weight(Fp4Scheme.MXFP4, 16, 64, seed=1)
    scales[3, 1] = 0xFF
    got = kernels.fp4_linear_triton(torch.randn(2, 64), qweight, scales, None, Fp4Scheme.MXFP4)
    assert torch.isnan(got[:, 3]).all() and not torch.isnan(got[:, [0, 1, 2, 4]]).any()
