"""The Triton sparse MLA decode kernel (densa.kernels.triton.sparse_latent_decode) against the
torch reference the CPU kernel is tested against (latent_attention's _torch_sparse_decode:
gather the selected rows, one SDPA), in Triton's interpreter: FP32, BF16 and FP8 pages (static
and per-row exponent scales, as the CPU path reads them), shuffled pages of several sizes,
top-k below and above the contexts (-1 padding), splits of the selected rows with several
blocks each, more heads than one program holds, and a padding row with no selection; and a
tiny GLM-5 through the engine on the Triton backend, its decode steps through the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import densa.model.latent_attention as latent_attention
from densa.engine.llm import LLM
from densa.formats.kv_format import KVFormat
from densa.kernels.cpu.kv_store import store_kv
from densa.kernels.triton.sparse_latent_decode import choose_num_splits, sparse_latent_decode
from densa.model.attention import AttentionGroup, build_group
from densa.model.kv_layout import LatentKVCache
from densa.model.latent_attention import sparse_absorbed_decode
from densa.sampling_params import SamplingParams
from tests.tiny_families import save_tiny

R, ROPE, HEADS = 32, 8, 6
ATOL, RTOL = 2e-5, 1e-4
# (KV dtype, FP8 scale policy): one case per way of reading rows and their scales.
KINDS = [("float32", "dynamic"), ("bfloat16", "dynamic"), ("fp8_e4m3", "static"),
         ("fp8_e4m3", "dynamic")]  # fmt: skip
KIND_IDS = ["fp32", "bf16", "fp8-static", "fp8-dynamic"]


def _case(
    kv_dtype: str, policy: str, seq_lens: list[int], topk: int, page_size: int,
    rank: int = R, heads: int = HEADS, seed: int = 0,
) -> tuple[torch.Tensor, LatentKVCache, AttentionGroup, torch.Tensor]:  # fmt: skip
    """Random latent rows for every position of every sequence in shuffled pages, a query per
    sequence, and each sequence's top-k: min(topk, len) distinct positions, then -1."""
    gen = torch.Generator().manual_seed(seed)
    fmt = KVFormat.of(kv_dtype, policy)
    pages_needed = [max(1, -(-n // page_size)) for n in seq_lens]
    num_pages = sum(pages_needed) + 1  # one page no sequence owns
    latent = torch.zeros(num_pages, 1, page_size, rank + ROPE, dtype=fmt.storage_dtype)
    scale = None
    if fmt.row_scale_dtype is not None:
        scale = torch.zeros(num_pages, 1, page_size, dtype=fmt.row_scale_dtype)
    elif fmt.is_fp8:
        scale = torch.tensor(0.02)  # static: one scale for the layer
    cache = LatentKVCache(latent, scale, fmt)
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for count in pages_needed:
        tables.append(order[start : start + count])
        start += count
    slots = [(t[p // page_size], p % page_size) for t, n in zip(tables, seq_lens, strict=True)
             for p in range(n)]  # fmt: skip
    rows = torch.randn(len(slots), 1, rank + ROPE, generator=gen) * 2
    store_kv(fmt, cache.latent, cache.scale, torch.tensor([s[0] for s in slots]),
             torch.tensor([s[1] for s in slots]), rows)  # fmt: skip
    positions = torch.full((len(seq_lens), topk), -1, dtype=torch.long)
    for b, n in enumerate(seq_lens):
        chosen = torch.randperm(n, generator=gen)[: min(topk, n)]
        positions[b, : len(chosen)] = chosen
    group = build_group(0, tables, seq_lens, [1] * len(seq_lens), page_size, torch.device("cpu"))
    query = torch.randn(len(seq_lens), heads, rank + ROPE, generator=gen)
    return query, cache, group, positions


def _triton(
    query: torch.Tensor, cache: LatentKVCache, group: AttentionGroup, positions: torch.Tensor,
    rank: int = R, **kw: int | None,
) -> torch.Tensor:  # fmt: skip
    return sparse_latent_decode(
        query, cache.latent, group.page_table, positions, 0.13, rank, cache.scale,
        cache.kv_format, **kw,
    )  # fmt: skip


def _reference(
    query: torch.Tensor, cache: LatentKVCache, group: AttentionGroup, positions: torch.Tensor,
    rank: int = R,
) -> torch.Tensor:  # fmt: skip
    return sparse_absorbed_decode(query, cache, group, positions, 0.13, rank, "torch")


@pytest.mark.parametrize(("kv_dtype", "policy"), KINDS, ids=KIND_IDS)
@torch.inference_mode()
def test_equals_the_torch_reference_for_every_page_format(kv_dtype: str, policy: str) -> None:
    # top-k 16: below two contexts, above the third (its row ends in -1s).
    case = _case(kv_dtype, policy, [40, 9, 23], topk=16, page_size=4)
    out = _triton(*case)
    assert out.shape == (3, HEADS, R) and out.dtype == torch.float32
    torch.testing.assert_close(out, _reference(*case), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("seq_lens", "topk", "page_size", "splits"),
    [
        ([5], 3, 1, None),  # one sequence, one-token pages
        ([70, 12], 48, 16, 2),  # two splits of 32 rows: two blocks of 16 in the first
        ([30, 1, 17, 64, 8], 64, 8, 3),  # top-k above every context but one: mostly -1
    ],
    ids=["batch1-page1", "batch2-page16-splits", "batch5-page8-padded"],
)
@torch.inference_mode()
def test_batches_page_sizes_splits_and_padding(
    seq_lens: list[int], topk: int, page_size: int, splits: int | None
) -> None:
    case = _case("fp8_e4m3", "dynamic", seq_lens, topk, page_size, seed=len(seq_lens))
    out = _triton(*case, num_splits=splits, block_n=16)
    torch.testing.assert_close(out, _reference(*case), atol=ATOL, rtol=RTOL)


@torch.inference_mode()
def test_heads_past_one_program_and_a_rank_not_a_power_of_two() -> None:
    # 20 heads: two head blocks of 16, the second mostly masked; r = 24 pads to 32.
    query, cache, group, positions = _case("bfloat16", "dynamic", [26, 11], 12, 4, 24, 20)
    out = _triton(query, cache, group, positions, rank=24, block_n=16)
    reference = _reference(query, cache, group, positions, rank=24)
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)


@torch.inference_mode()
def test_a_row_with_nothing_selected_gets_zeros_and_bf16_queries_stay_bf16() -> None:
    query, cache, group, positions = _case("bfloat16", "dynamic", [20, 20], 8, 4)
    positions[1] = -1  # a CUDA-graph padding row: the indexer chose nothing
    out = _triton(query.bfloat16(), cache, group, positions)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    expected = _reference(query, cache, group, positions)[:1]  # its row 1: whatever SDPA gives
    torch.testing.assert_close(out[:1].float(), expected, atol=2e-2, rtol=2e-2)
    # A position past the page table reads nothing, as -1 does (no out-of-bounds read).
    positions[0, -1] = -1
    beyond = positions.clone()
    beyond[0, -1] = group.page_table.shape[1] * cache.page_size
    assert torch.equal(
        _triton(query, cache, group, beyond), _triton(query, cache, group, positions)
    )


@torch.inference_mode()
def test_the_triton_backend_dispatches_to_the_kernel() -> None:
    case = _case("fp8_e4m3", "dynamic", [33, 7], 16, 4)
    query, cache, group, positions = case
    ours = sparse_absorbed_decode(query, cache, group, positions, 0.13, R, "triton")
    torch.testing.assert_close(ours, _triton(*case), atol=0, rtol=0)


def test_split_choice_from_shapes_only() -> None:
    cpu = torch.device("cpu")  # 4 "multiprocessors" when interpreting
    assert choose_num_splits(64, 2048, 32, cpu) == 1  # enough programs already
    assert choose_num_splits(1, 2048, 32, cpu) == 8
    assert choose_num_splits(1, 16, 32, cpu) == 1  # one block of rows: nothing to split


def test_the_triton_backend_generates_the_cpu_backends_tokens_with_sparse_decode(
    tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GLM-5 in small (top-k 16) with FP8 pages: two prompts past the top-k and one short one
    decode together, each step's sparse attention by the Triton kernel (interpreted)."""
    model_dir = save_tiny("glm_moe_dsa", tmp_path / "glm", smollm2_dir)
    prompts = [[1, *range(100, 140)], [1, *range(700, 726)], [1, 9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    settings = dict(num_kv_pages=64, page_size=4, max_model_len=64, max_num_batched_tokens=128)
    expected = [r.token_ids for r in LLM(str(model_dir), kv_cache_dtype="fp8_e4m3", **settings)
                .generate(prompts, greedy)]  # fmt: skip
    batches: list[int] = []
    kernel = latent_attention._SPARSE_DECODE["triton"]

    def counting(*args: object) -> torch.Tensor:
        batches.append(args[3].shape[0])  # type: ignore[attr-defined]
        return kernel(*args)  # type: ignore[arg-type]

    monkeypatch.setitem(latent_attention._SPARSE_DECODE, "triton", counting)
    llm = LLM(str(model_dir), kv_cache_dtype="fp8_e4m3", attention_backend="triton", **settings)
    assert [r.token_ids for r in llm.generate(prompts, greedy)] == expected
    assert batches and set(batches) == {3}  # every decode step, all three sequences at once
