"""Triton paged decode and prefill attention against the torch reference (paged_attention_ref),
over every cache format: fp32/bf16/fp16 pages, FP8 pages with static, float or exponent scales."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.reference.paged_attention import paged_attention_reference
from densa.kernels.triton.decode_attention import choose_num_splits, paged_decode_attention
from densa.kernels.triton.prefill_attention import paged_prefill_attention
from tests.kernels.test_paged_attention import make_case

ATOL, RTOL = 2e-5, 1e-4
# The interpreter is slow: one case per way of reading values and scales.
CACHE_KINDS = [
    (torch.float32, "none"),
    (torch.bfloat16, "none"),
    (torch.float8_e4m3fn, "static"),
    (torch.float8_e4m3fn, "dynamic"),
    (torch.float8_e4m3fn, "exponent"),
]
KIND_IDS = ["fp32", "bf16", "fp8-static", "fp8-dynamic", "fp8-exponent"]


def decode(case, num_splits=None):  # type: ignore[no-untyped-def]
    return paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.page_table, case.seq_lens, case.sm_scale,
        case.k_scale, case.v_scale, num_splits=num_splits,
    )  # fmt: skip


@pytest.mark.parametrize(("dtype", "scale_mode"), CACHE_KINDS, ids=KIND_IDS)
def test_decode_matches_the_reference(dtype: torch.dtype, scale_mode: str) -> None:
    # GQA (4 query heads per kv head); a 1-token sequence, one ending mid-page, one spanning blocks.
    case = make_case([1, 17, 75], [1, 1, 1], dtype, scale_mode, heads=(8, 2, 32), page_size=4)
    out = decode(case, num_splits=3)
    assert out.dtype == case.query.dtype
    torch.testing.assert_close(out, case.reference(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_splits_agree_and_ignore_empty_splits(num_splits: int) -> None:
    # 5 splits over a 3-page table: the last splits hold no tokens for the short sequence.
    case = make_case([3, 40], [1, 1], heads=(6, 3, 16), page_size=16)
    torch.testing.assert_close(decode(case, num_splits), case.reference(), atol=ATOL, rtol=RTOL)


def test_decode_gives_zeros_for_an_empty_padding_row() -> None:
    case = make_case([9, 9], [1, 1], heads=(4, 4, 16), page_size=4)
    expected = case.reference()[0]
    case.seq_lens[1] = 0  # what a CUDA-graph padding row looks like
    out = decode(case, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], expected, atol=ATOL, rtol=RTOL)


def test_decode_in_half_precision_returns_half() -> None:
    case = make_case([30, 7], [1, 1], torch.float16, heads=(4, 2, 32), page_size=8)
    out = paged_decode_attention(
        case.query.half(), case.k_cache, case.v_cache, case.page_table, case.seq_lens,
        case.sm_scale,
    )  # fmt: skip
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), case.reference(), atol=3e-3, rtol=3e-3)


def test_split_choice_fills_the_gpu_but_never_exceeds_the_context() -> None:
    cpu = torch.device("cpu")
    assert choose_num_splits(64, 8, 4096, cpu) == 1  # 512 programs already
    assert choose_num_splits(1, 1, 4096, cpu) == 8  # 2 per (interpreter) multiprocessor
    assert choose_num_splits(1, 1, 16, cpu) == 1  # one block of tokens: nothing to split


@pytest.mark.parametrize(("dtype", "scale_mode"), CACHE_KINDS, ids=KIND_IDS)
def test_prefill_matches_the_reference(dtype: torch.dtype, scale_mode: str) -> None:
    # A whole prompt, a chunk after a cached prefix longer than a block, a short chunk, one token.
    case = make_case(
        [9, 100, 70, 5], [9, 30, 3, 1], dtype, scale_mode, heads=(8, 2, 32), page_size=4
    )
    out = paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.page_table, case.seq_lens, case.query_lens,
        case.sm_scale, case.k_scale, case.v_scale, max_query_len=30,
    )  # fmt: skip
    torch.testing.assert_close(out, case.reference(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scale_mode", ["static", "exponent"])
def test_prefill_reads_its_own_chunk_from_new_kv(scale_mode: str) -> None:
    case = make_case([20, 90], [20, 70], torch.float8_e4m3fn, scale_mode, heads=(4, 2, 16))
    gen = torch.Generator().manual_seed(3)
    # Views with different row strides, as the model's k and v slices of its q|k|v output are.
    new_kv = (torch.randn(90, 3, 16, generator=gen)[:, :2], torch.randn(90, 2, 16, generator=gen))
    out = paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, case.page_table, case.seq_lens, case.query_lens,
        case.sm_scale, case.k_scale, case.v_scale, new_kv,
    )  # fmt: skip
    expected = paged_attention_reference(
        *case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale, new_kv=new_kv
    )
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
