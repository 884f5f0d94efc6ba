"""The tiled (flash-style) prefill attention: densa's C++ kernel on both code paths and its torch
fallback against the torch reference, for every KV format the engine stores, over contexts of
several key blocks and query tiles; and a row's bits fixed by its own position (any chunking,
any batch)."""

from __future__ import annotations

import pytest
import torch

from densa.kernels.cpu import native
from densa.kernels.cpu import prefill_attention as prefill
from densa.kernels.reference.paged_attention import paged_attention_reference
from tests.kernels.test_paged_attention import CACHE_KINDS, KIND_IDS, assert_close, make_case

# The engine's KV formats (what the C++ kernel reads): fp32, bf16, fp8 unscaled / static /
# exponent scales, int8 with fp16 row scales.
NATIVE = [0, 1, 3, 4, 6, 7]
NATIVE_KINDS = [CACHE_KINDS[i] for i in NATIVE]
NATIVE_IDS = [KIND_IDS[i] for i in NATIVE]
# 1.5B-shaped GQA (6 query heads per kv head, d 128), SmolLM2's (3 per kv head, d 64), MHA.
HEADS = [(12, 2, 128), (9, 3, 64), (4, 4, 32)]
HEAD_IDS = ["gqa12-2-d128", "gqa9-3-d64", "mha4-d32"]
# A whole fresh prompt over several key blocks (64) and query tiles, a chunk behind cached
# context, a single-row chunk and a short one.
SEQ_LENS, QUERY_LENS = [300, 200, 70, 9], [300, 77, 1, 9]

needs_native = pytest.mark.skipif(not native.is_available(), reason="C++ kernels not built")


def _skip_unless_runs(isa: str) -> None:
    ext = native.load()
    if isa == "avx512_vnni" and (ext is None or ext.best_isa() != isa):
        pytest.skip("this CPU has no AVX-512 VNNI")


def _run(case, new_kv=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    args = (*case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale)
    return prefill.paged_prefill_attention(*args, new_kv=new_kv)


def _fresh_rows(case, seq_lens: list[int], query_lens: list[int]):  # type: ignore[no-untyped-def]
    lens = list(zip(seq_lens, query_lens, strict=True))
    new_k = torch.cat([k[n - q :] for k, (n, q) in zip(case.dense_k, lens, strict=True)])
    new_v = torch.cat([v[n - q :] for v, (n, q) in zip(case.dense_v, lens, strict=True)])
    return new_k, new_v


@needs_native
@pytest.mark.parametrize("forced_isa", ["avx512_vnni", "avx2"], indirect=True)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize(("dtype", "scale_mode"), NATIVE_KINDS, ids=NATIVE_IDS)
def test_the_kernel_matches_the_reference(
    forced_isa: str, dtype: torch.dtype, scale_mode: str, heads: tuple[int, int, int]
) -> None:
    _skip_unless_runs(forced_isa)
    case = make_case(SEQ_LENS, QUERY_LENS, dtype, scale_mode, heads, page_size=16)
    assert prefill._native_reads(case.query, case.k_cache, case.k_scale)
    assert_close(_run(case), case.reference())


@needs_native
@pytest.mark.parametrize("forced_isa", ["avx512_vnni", "avx2"], indirect=True)
@pytest.mark.parametrize(
    "heads", [(17, 1, 36), (48, 1, 16), (64, 1, 8)], ids=["g17-d36", "g48-d16", "mqa64-d8"]
)
def test_wide_groups_and_odd_head_dims(forced_isa: str, heads: tuple[int, int, int]) -> None:
    """A kv head with many query heads fills a tile with one row (G = 48 is the most both code
    paths hold; beyond, the torch path answers), and a head dim a multiple of 4 only."""
    _skip_unless_runs(forced_isa)
    dtype, scale_mode = NATIVE_KINDS[-1]  # int8 pages with row scales
    case = make_case([70, 9], [70, 9], dtype, scale_mode, heads, page_size=16)
    native_runs = heads[0] // heads[1] <= prefill.MAX_NATIVE_GROUP
    assert prefill._native_reads(case.query, case.k_cache, case.k_scale) == native_runs
    assert_close(_run(case), case.reference())


@needs_native
@pytest.mark.parametrize("forced_isa", ["avx512_vnni", "avx2"], indirect=True)
@pytest.mark.parametrize(("dtype", "scale_mode"), NATIVE_KINDS[2:], ids=NATIVE_IDS[2:])
def test_quantized_pages_read_the_chunk_as_computed(
    forced_isa: str, dtype: torch.dtype, scale_mode: str
) -> None:
    """FP8 / INT8 pages: the chunk's own positions come from new_kv (attention.py's rule)."""
    _skip_unless_runs(forced_isa)
    case = make_case(SEQ_LENS, QUERY_LENS, dtype, scale_mode, (12, 2, 128), page_size=4)
    new_kv = _fresh_rows(case, SEQ_LENS, QUERY_LENS)
    args = (*case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale)
    assert_close(_run(case, new_kv), paged_attention_reference(*args, new_kv=new_kv))


@pytest.mark.parametrize(("dtype", "scale_mode"), CACHE_KINDS, ids=KIND_IDS)
def test_the_torch_fallback_matches_the_reference(
    dtype: torch.dtype, scale_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefill, "KEY_BLOCK", 48)  # several blocks, not page-aligned
    case = make_case(SEQ_LENS, QUERY_LENS, dtype, scale_mode, (9, 3, 64), page_size=16)
    args = (*case.args(), case.query_lens, case.sm_scale, case.k_scale, case.v_scale)
    new_kv = _fresh_rows(case, SEQ_LENS, QUERY_LENS)
    assert_close(prefill.tiled_prefill_attention(*args), case.reference())
    expected = paged_attention_reference(*args, new_kv=new_kv)
    assert_close(prefill.tiled_prefill_attention(*args, new_kv=new_kv), expected)


@needs_native
@pytest.mark.parametrize("kind", [0, 1, 7], ids=["fp32", "bf16", "int8"])
def test_a_row_computes_the_same_in_any_chunk_and_batch(kind: int) -> None:
    """Rows of one 260-token prompt, computed in one chunk, in chunks of 37 and 100 rows, and
    beside other sequences, are bit-identical: each row's reduction order is its position's."""
    dtype, scale_mode = CACHE_KINDS[kind]
    case = make_case([260, 150], [260, 150], dtype, scale_mode, (12, 2, 128), page_size=16)
    rows = case.query[:260]
    table, k, v, ks, vs = case.page_table, case.k_cache, case.v_cache, case.k_scale, case.v_scale

    def chunked(size: int) -> torch.Tensor:
        parts = []
        for start in range(0, 260, size):
            end = min(260, start + size)
            lens = torch.tensor([end], dtype=torch.int32)
            q_lens = torch.tensor([end - start], dtype=torch.int32)
            parts.append(prefill.paged_prefill_attention(
                rows[start:end].contiguous(), k, v, table[:1], lens, q_lens, case.sm_scale,
                ks, vs,
            ))  # fmt: skip
        return torch.cat(parts)

    whole = chunked(260)
    assert torch.equal(whole, chunked(37)) and torch.equal(whole, chunked(100))
    assert torch.equal(whole, _run(case)[:260])  # beside a second sequence


def test_the_fallback_holds_one_key_block_of_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory is bounded by the tile: no score matrix wider than KEY_BLOCK keys is formed."""
    widths: list[int] = []
    real_matmul = torch.Tensor.__matmul__

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = real_matmul(a, b)
        widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(prefill, "KEY_BLOCK", 64)
    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    case = make_case([400], [400], torch.float32, "none", (4, 4, 32), page_size=16)
    prefill.tiled_prefill_attention(*case.args(), case.query_lens, case.sm_scale)
    assert widths and max(widths) <= 64
