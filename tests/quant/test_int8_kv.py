"""INT8 KV rows: codes and fp16 scales as documented, errors within half a step of the row's
scale, no NaN/inf ever stored, and ~1.94x BF16's resident tokens."""

from __future__ import annotations

import torch

from densa.formats import int8_kv
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig
from densa.model.kv_pages import allocate_kv_caches, bytes_per_token


def test_rows_round_to_codes_of_an_fp16_scale() -> None:
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    codes, scale = int8_kv.quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16
    assert scale.shape == (5, 3)
    torch.testing.assert_close(scale.float(), (x.abs().amax(-1) / 127).half().float())
    err = (int8_kv.dequantize_rows(codes, scale) - x).abs()
    assert (err <= scale.float().unsqueeze(-1) * 0.5 + 1e-7).all()
    assert codes.abs().max() <= 127


def test_zero_nan_and_huge_rows_stay_finite() -> None:
    x = torch.zeros(4, 1, 8)
    x[1, 0, 3] = float("nan")
    x[2, 0, :] = float("inf")
    x[3, 0, 0] = 3e38
    codes, scale = int8_kv.quantize_rows(x)
    assert torch.isfinite(scale.float()).all()
    assert (codes[0] == 0).all() and scale[0] == 0  # all-zero row
    assert codes[1, 0, 3] == 0  # NaN stored as 0
    assert (codes[2] == 127).all()  # saturates at the largest finite scale
    assert torch.isfinite(int8_kv.dequantize_rows(codes, scale)).all()


def test_store_scatters_codes_and_scales_into_their_slots() -> None:
    cache = torch.zeros(4, 2, 8, 16, dtype=torch.int8)
    scale = torch.zeros(4, 2, 8, dtype=torch.float16)
    x = torch.randn(3, 2, 16)
    pages, offsets = torch.tensor([3, 0, 3]), torch.tensor([7, 0, 1])
    int8_kv.store_int8(cache, scale, pages, offsets, x)
    codes, row_scale = int8_kv.quantize_rows(x)
    for t in range(3):
        assert torch.equal(cache[pages[t], :, offsets[t]], codes[t])
        assert torch.equal(scale[pages[t], :, offsets[t]], row_scale[t])
    assert int((cache != 0).any(-1).sum()) == 6  # nothing else written


def test_int8_holds_about_twice_bf16s_tokens(smollm2_dir) -> None:  # type: ignore[no-untyped-def]
    arch = ArchConfig.from_dir(smollm2_dir)
    ratio = bytes_per_token(arch, KVFormat.of("bfloat16")) / bytes_per_token(
        arch, KVFormat.of("int8")
    )
    assert ratio == 128 / 66  # per 64-value row: 64 codes + a 2-byte scale vs 128 bytes
    assert ratio >= 1.9


def test_allocation_has_fp16_row_scales(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    arch = ArchConfig.from_dir(tiny_model_dir)
    caches = allocate_kv_caches(arch, 6, 4, KVFormat.of("int8"), torch.device("cpu"))
    for cache in caches:
        assert cache.k.dtype == torch.int8 and cache.k.shape[:3] == (6, arch.num_kv_heads, 4)
        assert cache.k_scale is not None and cache.k_scale.dtype == torch.float16
        assert cache.k_scale.shape == cache.k.shape[:3] and cache.v_scale is not None
