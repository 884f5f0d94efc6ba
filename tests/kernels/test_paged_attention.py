"""Paged attention: the torch reference against naive dense attention, and the fast CPU paths
(fused Numba decode, SDPA prefill, mixed dispatcher) against the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from numba import njit

from densa.formats.fp8_kv import (
    FP8_MAX,
    quantize_fp8,
    quantize_fp8_exponent,
    quantize_fp8_static,
    scale_exponents,
)
from densa.kernels.cpu.numba_intrinsics import widen
from densa.kernels.cpu.paged_attention import (
    _choose_num_splits,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from densa.kernels.reference.paged_attention import (
    paged_attention_reference,
    write_kv_reference,
)

ATOL, RTOL = 1e-5, 1e-4

# (cache dtype, scale mode) pairs; scale modes only matter for fp8.
CACHE_KINDS = [
    (torch.float32, "none"),
    (torch.bfloat16, "none"),
    (torch.float16, "none"),
    (torch.float8_e4m3fn, "none"),
    (torch.float8_e4m3fn, "static"),
    (torch.float8_e4m3fn, "dynamic"),
    (torch.float8_e4m3fn, "exponent"),
    (torch.int8, "rows"),
]
KIND_IDS = ["fp32", "bf16", "fp16", "fp8", "fp8-static", "fp8-dynamic", "fp8-exponent", "int8"]
HEAD_CONFIGS = [(9, 3, 64), (4, 4, 32)]  # (num_heads, num_kv_heads, head_dim)
HEAD_IDS = ["gqa9-3-d64", "mha4-d32"]
# The decode kernel has dedicated code for GQA groups of 3 and 4 and a generic one for the rest.
DECODE_HEAD_CONFIGS = [*HEAD_CONFIGS, (8, 2, 32), (6, 3, 16)]
DECODE_HEAD_IDS = [*HEAD_IDS, "gqa8-2-d32", "gqa6-3-d16"]


@dataclass
class Case:
    """A filled paged cache plus the dense float32 K/V each sequence was built from."""

    query: torch.Tensor  # [total_q, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor  # int32 [B, max_pages], shuffled, padded with valid ids
    seq_lens: torch.Tensor  # int32 [B]
    query_lens: torch.Tensor  # int32 [B]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    dense_k: list[torch.Tensor]  # per sequence [L, Hkv, D]
    dense_v: list[torch.Tensor]
    sm_scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.query, self.k_cache, self.v_cache, self.page_table, self.seq_lens)

    def reference(self) -> torch.Tensor:
        return paged_attention_reference(
            *self.args(), self.query_lens, self.sm_scale, self.k_scale, self.v_scale
        )


def _garbage_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A cache whose unwritten slots hold NaN, so reading past seq_len is caught."""
    if dtype == torch.float8_e4m3fn:
        return torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)  # 0x7f is e4m3fn NaN
    if dtype == torch.int8:  # no NaN code: its unwritten rows' fp16 scales are NaN instead
        return torch.full(shape, 127, dtype=dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype = torch.float32,
    scale_mode: str = "none",
    heads: tuple[int, int, int] = (9, 3, 64),
    page_size: int = 16,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    pages_per_seq = [math.ceil(n / page_size) for n in seq_lens]
    max_pages = max(pages_per_seq) + 1  # + 1: every row carries padding
    num_pages = sum(pages_per_seq) + 3  # spare pages never referenced except as padding
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k_cache, v_cache = _garbage_cache(shape, dtype), _garbage_cache(shape, dtype)
    k_scale = v_scale = None
    if scale_mode == "static":
        k_scale, v_scale = torch.tensor(0.0125), torch.tensor(0.0075)
    elif scale_mode == "dynamic":
        k_scale = torch.full(shape[:3], float("nan"))
        v_scale = torch.full(shape[:3], float("nan"))
    elif scale_mode == "exponent":  # int8 power-of-two exponents; unwritten slots scale by 2**126
        k_scale = torch.full(shape[:3], 126, dtype=torch.int8)
        v_scale = torch.full(shape[:3], 126, dtype=torch.int8)
    elif scale_mode == "rows":  # INT8 KV's fp16 row scales
        k_scale = torch.full(shape[:3], float("nan"), dtype=torch.float16)
        v_scale = torch.full(shape[:3], float("nan"), dtype=torch.float16)

    # Non-contiguous pages: a shuffled pool dealt out to the sequences; padding repeats page ids.
    pool = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.empty((len(seq_lens), max_pages), dtype=torch.int32)
    dense_k, dense_v, used = [], [], 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        row = pool[used : used + n]
        used += n
        padding = pool[torch.randint(0, num_pages, (max_pages - n,), generator=gen)]
        page_table[i] = torch.cat([row, padding])
        k = 2.0 * torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        write_kv_reference(k_cache, page_table[i], 0, k, k_scale)
        write_kv_reference(v_cache, page_table[i], 0, v, v_scale)
        dense_k.append(k)
        dense_v.append(v)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return Case(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        k_scale=k_scale,
        v_scale=v_scale,
        dense_k=dense_k,
        dense_v=dense_v,
        sm_scale=1.0 / math.sqrt(head_dim),
    )


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """Float64 per-row softmax attention of the last len(q) positions; k, v: [L, Hkv, D]."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q_len):
        pos = seq_len - q_len + j
        for h in range(num_heads):
            keys = k[: pos + 1, h // group].double()
            scores = keys @ q[j, h].double() * sm_scale
            out[j, h] = torch.softmax(scores, 0) @ v[: pos + 1, h // group].double()
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected.float(), atol=ATOL, rtol=RTOL)


# ---- the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_reference_matches_naive_dense_attention(page_size: int) -> None:
    case = make_case([1, 7, 33, 50], [1, 7, 5, 1], page_size=page_size, heads=(4, 2, 16))
    expected, start = [], 0
    for k, v, q_len in zip(case.dense_k, case.dense_v, case.query_lens.tolist(), strict=True):
        expected.append(naive_attention(case.query[start : start + q_len], k, v, case.sm_scale))
        start += q_len
    assert_close(case.reference(), torch.cat(expected))


def test_reference_dequantizes_fp8_scales() -> None:
    case = make_case([20], [20], torch.float8_e4m3fn, "dynamic", heads=(2, 1, 8), page_size=4)
    assert case.k_scale is not None
    pages = case.page_table[0, :5].long()
    dense_k = case.k_cache[pages].float() * case.k_scale[pages].unsqueeze(-1)
    dense_k = dense_k.permute(1, 0, 2, 3).reshape(1, 20, 8).transpose(0, 1)
    # Quantization error is bounded by half an fp8 step (2**-4 relative, e4m3 has 3 mantissa bits).
    torch.testing.assert_close(dense_k, case.dense_k[0], atol=1e-6, rtol=2**-4)


def test_reference_dequantizes_fp8_exponent_scales() -> None:
    case = make_case([20], [20], torch.float8_e4m3fn, "exponent", heads=(2, 1, 8), page_size=4)
    assert case.k_scale is not None and case.k_scale.dtype == torch.int8
    pages = case.page_table[0, :5].long()
    scales = torch.exp2(case.k_scale[pages].float()).unsqueeze(-1)
    dense_k = (case.k_cache[pages].float() * scales).permute(1, 0, 2, 3).reshape(1, 20, 8)
    torch.testing.assert_close(dense_k.transpose(0, 1), case.dense_k[0], atol=1e-6, rtol=2**-4)


# ---- fp8 quantization and widening ------------------------------------------------------------


def test_scale_exponents_put_the_row_max_in_the_top_binade() -> None:
    amax = torch.tensor([448.0, 449.0, 224.0, 224.5, 1.0, 3e-30, 3.4e38, 0.0])
    exponents = scale_exponents(amax)
    assert exponents.dtype == torch.int8
    assert exponents.tolist() == [0, 1, -1, 0, -8, -106, 119, 0]  # 3.4e38: clamped
    scaled = torch.ldexp(amax, -exponents.int())
    assert ((scaled > 224) & (scaled <= 448))[:-2].all()


def test_quantize_fp8_exponent_is_exact_scaling_then_one_rounding() -> None:
    x = torch.randn(64, 32) * torch.logspace(-20, 20, 64).unsqueeze(1)
    values, exponents = quantize_fp8_exponent(x)
    expected = torch.ldexp(x, -exponents.int().unsqueeze(1)).to(torch.float8_e4m3fn)
    assert torch.equal(values.view(torch.uint8), expected.view(torch.uint8))
    restored = values.float() * torch.exp2(exponents.float()).unsqueeze(1)
    torch.testing.assert_close(restored, x, atol=0, rtol=2**-4)


@pytest.mark.parametrize("mode", ["dynamic", "static", "exponent"])
def test_quantize_fp8_never_produces_nan_or_inf(mode: str) -> None:
    big = torch.tensor(
        [[1e30, -1e30, 3.4e38, 0.0], [float("inf"), float("-inf"), 1.0, -2.0], [0.0] * 4]
    )
    if mode == "exponent":
        values, exponents = quantize_fp8_exponent(big)
        scales = torch.exp2(exponents.float())
    elif mode == "static":
        values = quantize_fp8_static(big, torch.tensor(1e-3))
        scales = torch.tensor(1e-3)
    else:
        values, scales = quantize_fp8(big)
    widened = values.float()
    assert torch.isfinite(widened).all() and torch.isfinite(scales).all()
    assert widened.abs().max() <= FP8_MAX
    assert (widened[2] == 0).all()  # an all-zero row stays exactly zero
    assert widened[0].abs().max() > FP8_MAX / 2  # the row max lands in the top binade, not NaN


@njit(cache=True)
def _widen_all(raw: np.ndarray) -> np.ndarray:
    out = np.empty(raw.shape[0], dtype=np.float32)
    for i in range(raw.shape[0]):
        out[i] = widen(raw[i])
    return out


def test_widen_fp8_matches_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float()
    got = torch.from_numpy(_widen_all(codes.numpy())) * 256.0  # kv_views.RAW_VIEW factor for fp8
    finite = ~torch.isnan(expected)  # 0x7f / 0xff (NaN) are documented as not special-cased
    assert finite.sum() == 254
    assert torch.equal(got[finite], expected[finite])


@pytest.mark.parametrize(
    "dtype, raw", [(torch.bfloat16, torch.int16), (torch.float16, torch.uint16)]
)
def test_widen_16_bit_matches_torch_for_every_pattern(dtype: torch.dtype, raw: torch.dtype) -> None:
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    expected = bits.view(dtype).float()
    got = torch.from_numpy(_widen_all(bits.view(raw).numpy()))
    torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)


# ---- decode -----------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", DECODE_HEAD_CONFIGS, ids=DECODE_HEAD_IDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype, scale_mode", CACHE_KINDS, ids=KIND_IDS)
def test_decode_matches_reference(
    dtype: torch.dtype, scale_mode: str, page_size: int, heads: tuple[int, int, int]
) -> None:
    seq_lens = [1, 5, 17, 64, 300]
    case = make_case(seq_lens, [1] * len(seq_lens), dtype, scale_mode, heads, page_size)
    out = paged_decode_attention(*case.args(), case.sm_scale, case.k_scale, case.v_scale)
    assert_close(out, case.reference())


@pytest.mark.parametrize("dtype, scale_mode", CACHE_KINDS, ids=KIND_IDS)
def test_decode_split_k_long_sequence(dtype: torch.dtype, scale_mode: str) -> None:
    # One long sequence: too few (sequence, kv head) pairs, so the kernel splits the sequence.
    assert _choose_num_splits(3, 3001, 2) > 1
    case = make_case([3001], [1], dtype, scale_mode, page_size=16)
    out = paged_decode_attention(*case.args(), case.sm_scale, case.k_scale, case.v_scale)
    assert_close(out, case.reference())


def test_decode_writes_into_out_and_accepts_int64_metadata() -> None:
    case = make_case([9, 40], [1, 1], torch.bfloat16, page_size=4)
    out = torch.full(case.query.shape, float("nan"))
    result = paged_decode_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.page_table.long(),
        case.seq_lens.long(),
        case.sm_scale,
        out=out,
    )
    assert result is out
    assert_close(out, case.reference())


def test_choose_num_splits() -> None:
    assert _choose_num_splits(96, 1024, 2) == 1  # enough pairs already
    assert _choose_num_splits(3, 200, 2) == 1  # too short to split
    splits = _choose_num_splits(3, 4096, 2)
    assert (3 * splits) % 2 == 0  # balanced over two threads


# ---- prefill and mixed batches ----------------------------------------------------------------


@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=HEAD_IDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype, scale_mode", CACHE_KINDS, ids=KIND_IDS)
def test_prefill_matches_reference(
    dtype: torch.dtype, scale_mode: str, page_size: int, heads: tuple[int, int, int]
) -> None:
    # A fresh prompt, a single token, chunks with cached context before them, a decode row.
    seq_lens, query_lens = [20, 1, 45, 130, 9], [20, 1, 7, 33, 1]
    case = make_case(seq_lens, query_lens, dtype, scale_mode, heads, page_size)
    args = (*case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale)
    assert_close(paged_prefill_attention(*args), case.reference())


@pytest.mark.parametrize("dtype, scale_mode", CACHE_KINDS[3:], ids=KIND_IDS[3:])
def test_prefill_reads_its_own_rows_from_new_kv(dtype: torch.dtype, scale_mode: str) -> None:
    # The new rows' unquantized K/V replace their cached copies; earlier context stays cached.
    seq_lens, query_lens = [20, 45, 130, 9], [20, 7, 33, 1]
    case = make_case(seq_lens, query_lens, dtype, scale_mode, page_size=4)
    lens = list(zip(seq_lens, query_lens, strict=True))
    new_k = torch.cat([k[n - q :] for k, (n, q) in zip(case.dense_k, lens, strict=True)])
    new_v = torch.cat([v[n - q :] for v, (n, q) in zip(case.dense_v, lens, strict=True)])
    args = (*case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale)
    expected = paged_attention_reference(*args, new_kv=(new_k, new_v))
    assert_close(paged_prefill_attention(*args, new_kv=(new_k, new_v)), expected)
    # A whole fresh prompt read from new_kv is exact attention over the unquantized K/V.
    fresh = make_case([20], [20], dtype, scale_mode, page_size=4)
    fresh_args = (*fresh.args(), fresh.query_lens, fresh.sm_scale, fresh.k_scale, fresh.v_scale)
    exact = naive_attention(fresh.query, fresh.dense_k[0], fresh.dense_v[0], fresh.sm_scale)
    got = paged_prefill_attention(*fresh_args, new_kv=(fresh.dense_k[0], fresh.dense_v[0]))
    assert_close(got, exact)


@pytest.mark.parametrize("query_len", [1, 16])
def test_prefill_equal_chunks_single_sequence(query_len: int) -> None:
    case = make_case([100], [query_len], torch.float16, page_size=16)
    args = (*case.args(), case.query_lens, case.sm_scale)
    assert_close(paged_prefill_attention(*args), case.reference())


@pytest.mark.parametrize(
    "query_lens", [[1, 1, 1], [12, 30, 5], [1, 30, 1]], ids=["decode", "prefill", "mixed"]
)
def test_paged_attention_dispatch(query_lens: list[int]) -> None:
    case = make_case([40, 30, 77], query_lens, torch.float8_e4m3fn, "dynamic", page_size=4)
    args = (*case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale)
    assert_close(paged_attention(*args), case.reference())


def test_fast_paths_ignore_garbage_past_seq_len() -> None:
    # make_case fills unwritten slots (and padding pages) with NaN; outputs must stay finite.
    case = make_case([3, 18], [3, 2], torch.float32, page_size=16)
    prefill = paged_prefill_attention(*case.args(), case.query_lens, case.sm_scale)
    decode_case = make_case([3, 18], [1, 1], torch.float32, page_size=16)
    decode = paged_decode_attention(*decode_case.args(), decode_case.sm_scale)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()


def test_decode_rejects_inputs_that_would_read_out_of_bounds() -> None:
    case = make_case([9, 40], [1, 1], torch.float32, page_size=4)
    bad_table = case.page_table.clone()
    bad_table[1, -1] = case.k_cache.shape[0]
    with pytest.raises(IndexError):
        paged_decode_attention(
            case.query, case.k_cache, case.v_cache, bad_table, case.seq_lens, 1.0
        )
    too_long = torch.tensor([9, 4 * case.page_table.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError):
        paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.page_table, too_long, 1.0
        )
    with pytest.raises(ValueError):
        paged_decode_attention(*case.args(), 1.0, k_scale=torch.ones(3))
