"""FP8 KV store path: the fused Numba store kernels against the torch reference (bit for bit),
round-trip error, never-NaN on huge values, the attention backends on FP8 pages, scale files,
and the clear error when a build cannot run FP8."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from densa.formats import fp8_kv
from densa.formats.fp8_kv import (
    FP8_MAX,
    KVScales,
    fp8_support_error,
    quantize_fp8_exponent,
    quantize_fp8_static,
)
from densa.kernels.cpu.kv_store import store_fp8
from densa.kernels.reference.paged_attention import (
    paged_attention_reference,
)
from densa.model.attention import (
    AttentionMetadata,
    CpuAttentionBackend,
    LayerKVCache,
    TorchAttentionBackend,
    build_group,
    paged_attention,
)

FP8 = torch.float8_e4m3fn
NUM_PAGES, HEADS, PAGE, DIM = 12, 3, 4, 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _scattered_slots(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (page, offset) slots in shuffled order, like a real page table's."""
    slots = torch.randperm(NUM_PAGES * PAGE, generator=torch.Generator().manual_seed(seed))
    slots = slots[:num_tokens]
    return slots // PAGE, slots % PAGE


def _empty_cache() -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.zeros(NUM_PAGES, HEADS, PAGE, DIM, dtype=FP8)
    exponents = torch.full((NUM_PAGES, HEADS, PAGE), 99, dtype=torch.int8)  # "unwritten"
    return values, exponents


def _every_rounding_case() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties to even) and the float32
    values just either side of each midpoint, both signs: [N] float32, all |x| <= 448."""
    codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8)  # 0x7f is NaN
    grid = codes.view(FP8).float()  # ascending, 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 1e9))
    cases = torch.cat([grid, mids, below, above, torch.tensor([2.0**-10, 1e-30, 0.0])])
    return torch.cat([cases, -cases])


# ---- the e4m3 encoder ------------------------------------------------------------------------
def test_store_rounds_every_case_like_torch() -> None:
    cases = _every_rounding_case()
    rows = cases[: cases.numel() // DIM * DIM].view(-1, 1, DIM).expand(-1, HEADS, DIM)
    values = torch.zeros(rows.shape[0], HEADS, 1, DIM, dtype=FP8)
    pages, offsets = torch.arange(rows.shape[0]), torch.zeros(rows.shape[0], dtype=torch.long)
    store_fp8(values, torch.tensor(1.0), pages, offsets, rows)
    assert torch.equal(_bits(values[:, :, 0]), _bits(rows.to(FP8)))


# ---- dynamic (per token and head) and static scales: kernel == reference ---------------------
def _awkward_rows(num_tokens: int) -> torch.Tensor:
    """Rows spanning 1e-40 .. 1e38 in magnitude, with NaN, +-inf, -0.0 and all-zero rows."""
    gen = torch.Generator().manual_seed(1)
    magnitude = torch.logspace(-40, 38, num_tokens).view(-1, 1, 1)
    x = torch.randn(num_tokens, HEADS, DIM, generator=gen) * magnitude
    x[0, 0, 0], x[1, 1, 1], x[2, 2, 2] = float("nan"), float("inf"), float("-inf")
    x[3] = -0.0
    x[4, 1] = 0.0
    return x


def test_dynamic_store_matches_reference_bit_for_bit() -> None:
    x = _awkward_rows(40)
    pages, offsets = _scattered_slots(40)
    values, exponents = _empty_cache()
    store_fp8(values, exponents, pages, offsets, x)
    expected_values, expected_exponents = quantize_fp8_exponent(x)
    assert torch.equal(_bits(values[pages, :, offsets]), _bits(expected_values))
    assert torch.equal(exponents[pages, :, offsets], expected_exponents)
    untouched = torch.ones(NUM_PAGES, PAGE, dtype=torch.bool)
    untouched[pages, offsets] = False
    assert (exponents.permute(0, 2, 1)[untouched] == 99).all()


@pytest.mark.parametrize("scale", [1.0, 0.0625, 0.0123, 3e-5, 7.7])
def test_static_store_matches_reference_bit_for_bit(scale: float) -> None:
    x = _awkward_rows(40)
    pages, offsets = _scattered_slots(40)
    values, _ = _empty_cache()
    store_fp8(values, torch.tensor(scale), pages, offsets, x)
    expected = quantize_fp8_static(x, torch.tensor(scale))
    assert torch.equal(_bits(values[pages, :, offsets]), _bits(expected))


@pytest.mark.parametrize("dynamic", [True, False])
def test_torch_fallback_path_writes_the_same(dynamic: bool) -> None:
    # A non-contiguous cache takes the torch path (the one other devices use).
    x = _awkward_rows(20)
    pages, offsets = _scattered_slots(20, seed=3)
    fast, fast_exp = _empty_cache()
    wide = torch.zeros(NUM_PAGES, HEADS, PAGE, 2 * DIM, dtype=FP8)
    slow, slow_exp = wide[..., :DIM], _empty_cache()[1]
    assert not slow.is_contiguous()
    scale_fast = fast_exp if dynamic else torch.tensor(0.05)
    scale_slow = slow_exp if dynamic else torch.tensor(0.05)
    store_fp8(fast, scale_fast, pages, offsets, x)
    store_fp8(slow, scale_slow, pages, offsets, x)
    assert torch.equal(_bits(fast), _bits(slow.contiguous()))
    assert torch.equal(fast_exp, slow_exp) or not dynamic


def test_store_accepts_bf16_activations_and_rejects_other_caches() -> None:
    x = torch.randn(5, HEADS, DIM).to(torch.bfloat16)
    pages, offsets = _scattered_slots(5)
    values, exponents = _empty_cache()
    store_fp8(values, exponents, pages, offsets, x)
    expected, _ = quantize_fp8_exponent(x.float())
    assert torch.equal(_bits(values[pages, :, offsets]), _bits(expected))
    with pytest.raises(TypeError):
        store_fp8(torch.zeros(2, HEADS, PAGE, DIM), None, pages[:1] % 2, offsets[:1], x[:1])


# ---- round trip and range --------------------------------------------------------------------
def _dequantize(values: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    return values.float() * torch.exp2(exponents.float()).unsqueeze(-1)


def test_dynamic_round_trip_keeps_e4m3_relative_precision() -> None:
    gen = torch.Generator().manual_seed(2)
    magnitude = torch.logspace(-6, 6, 48).view(-1, 1, 1)
    x = torch.randn(48, HEADS, DIM, generator=gen) * magnitude
    pages, offsets = _scattered_slots(48)
    values, exponents = _empty_cache()
    store_fp8(values, exponents, pages, offsets, x)
    restored = _dequantize(values[pages, :, offsets], exponents[pages, :, offsets])
    # Elements within e4m3's normal range of their row (>= amax / 2**14) round to 3 mantissa
    # bits: relative error <= 2**-4. Smaller ones are subnormal: absolute error <= half a step.
    amax = x.abs().amax(-1, keepdim=True)
    step = torch.exp2(exponents[pages, :, offsets].float()).unsqueeze(-1) * 2.0**-9
    bound = torch.maximum(x.abs() * 2.0**-4, step / 2)
    assert ((restored - x).abs() <= bound).all()
    assert ((restored.abs().amax(-1, keepdim=True) / amax) > 0.9).all()


@pytest.mark.parametrize("dynamic", [True, False])
def test_huge_and_non_finite_values_never_become_nan_or_inf(dynamic: bool) -> None:
    x = torch.tensor([1e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 1e-45, 5.0, 0.0])
    x = x.repeat(DIM // 8).view(1, 1, DIM).expand(4, HEADS, DIM)
    pages, offsets = _scattered_slots(4)
    values, exponents = _empty_cache()
    scale = exponents if dynamic else torch.tensor(0.01)
    store_fp8(values, scale, pages, offsets, x)
    widened = values[pages, :, offsets].float()
    assert torch.isfinite(widened).all() and widened.abs().max() <= FP8_MAX
    # The row max lands in e4m3's top binade (dynamic) or saturates at 448 (static), never NaN.
    assert widened.abs().max() == FP8_MAX or (dynamic and widened.abs().max() > FP8_MAX / 2)
    if dynamic:
        assert torch.isfinite(
            _dequantize(values[pages, :, offsets], exponents[pages, :, offsets])
        ).all()


# ---- through the attention backends ----------------------------------------------------------
def _fp8_layer(mode: str) -> LayerKVCache:
    values_k, exp_k = _empty_cache()
    values_v, exp_v = _empty_cache()
    if mode == "dynamic":
        return LayerKVCache(values_k, values_v, exp_k, exp_v)
    return LayerKVCache(values_k, values_v, torch.tensor(0.03125), torch.tensor(0.0078125))


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_backends_store_fp8_and_attend_like_the_reference(mode: str) -> None:
    gen = torch.Generator().manual_seed(4)
    seq_len, heads_q = 22, 6
    pages = [7, 2, 9, 4, 11, 0]  # scattered pages of one sequence
    k = torch.randn(seq_len, HEADS, DIM, generator=gen) * 3
    v = torch.randn(seq_len, HEADS, DIM, generator=gen)
    q = torch.randn(seq_len, heads_q, DIM, generator=gen)
    cpu = torch.device("cpu")
    prefill = AttentionMetadata(  # the first 21 tokens as one prefill chunk
        slot_pages=torch.tensor([pages[p // PAGE] for p in range(seq_len - 1)]),
        slot_offsets=torch.arange(seq_len - 1) % PAGE,
        decode=None,
        prefill=build_group(0, [pages], [seq_len - 1], [seq_len - 1], PAGE, cpu),
    )
    decode = AttentionMetadata(  # then token 22 as a decode step
        slot_pages=torch.tensor([pages[(seq_len - 1) // PAGE]]),
        slot_offsets=torch.tensor([(seq_len - 1) % PAGE]),
        decode=build_group(0, [pages], [seq_len], [1], PAGE, cpu),
        prefill=None,
    )
    table = torch.tensor([pages], dtype=torch.int32)
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        cache = _fp8_layer(mode)
        chunk = slice(0, seq_len - 1)
        out = paged_attention(backend, q[chunk], k[chunk], v[chunk], cache, prefill, 0.25)
        # Prefill attends to its own chunk unquantized; the pages hold it quantized.
        lens = torch.tensor([seq_len - 1], dtype=torch.int32)
        expected = paged_attention_reference(
            q[chunk], cache.k, cache.v, table, lens, lens, 0.25, cache.k_scale, cache.v_scale,
            new_kv=(k[chunk], v[chunk]),
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
        last = slice(seq_len - 1, seq_len)
        out = paged_attention(backend, q[last], k[last], v[last], cache, decode, 0.25)
        # Decode reads every position, its own included, from the FP8 pages.
        lens, one = torch.tensor([seq_len], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
        expected = paged_attention_reference(
            q[last], cache.k, cache.v, table, lens, one, 0.25, cache.k_scale, cache.v_scale
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


# ---- static scale files ----------------------------------------------------------------------
def test_scales_from_amax_are_powers_of_two_with_headroom() -> None:
    scales = KVScales.from_amax([448.0, 10.6, 0.0], [0.6, 500.0, 1e-3], {"text": "t"})
    assert scales.k == (1.0, 2.0**-5, 1.0)  # 10.6 / 448 -> 2**-5 (10.6 <= 14)
    assert scales.v == (2.0**-9, 2.0, 2.0**-18)
    for amax, scale in zip(
        [448.0, 10.6, 0.6, 500.0, 1e-3], [1.0, 2**-5, 2**-9, 2.0, 2**-18], strict=True
    ):
        assert amax <= FP8_MAX * scale and (amax == 0 or amax > FP8_MAX * scale / 2)
    assert scales.calibration["k_amax"] == [448.0, 10.6, 0.0]


def test_scales_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "scales.json"
    scales = KVScales.from_amax([3.0, 5.0], [1.0, 2.0], {"model": "m"})
    scales.save(path)
    loaded = KVScales.load(path, num_layers=2)
    assert (loaded.k, loaded.v) == (scales.k, scales.v) and loaded.source == str(path)
    with pytest.raises(ValueError, match="2 layers but the model has 3"):
        KVScales.load(path, num_layers=3)
    (tmp_path / "bad.json").write_text('{"k_scale": [1.0]}')
    with pytest.raises(ValueError, match="not a densa-kv-scales"):
        KVScales.load(tmp_path / "bad.json", num_layers=1)
    with pytest.raises(ValueError, match="cannot read"):
        KVScales.load(tmp_path / "missing.json", num_layers=1)
    with pytest.raises(ValueError, match="finite"):
        KVScales(k=(1.0,), v=(math.inf,))


def test_scale_bytes_per_token() -> None:
    assert fp8_kv.scale_bytes_per_token(30, 3, "dynamic") == 180
    assert fp8_kv.scale_bytes_per_token(30, 3, "static") == 0
    with pytest.raises(ValueError):
        fp8_kv.scale_bytes_per_token(30, 3, "per-page")


# ---- where FP8 cannot run --------------------------------------------------------------------
def test_fp8_support_error_names_the_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fp8_support_error(torch.device("cpu")) is None
    monkeypatch.delattr(torch, "float8_e4m3fn")
    message = fp8_support_error(torch.device("cpu"))
    assert message is not None and "--kv-cache-dtype bfloat16" in message
