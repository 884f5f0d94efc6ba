"""The fused C++ decode step against the eager model: same hidden states and the same K/V bytes
in the pages, for dense / w4a8 / w8a8 / w5a8 / w5ma8 / w6a8 / w6ma8 weights and sharded q|k|v
projections, fp32 / bf16 / fp8 (dynamic and static) / int8 KV caches, with and without q/k/v
biases, on every code path this CPU runs (AVX2 forced too)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from densa.formats import fp8_kv
from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import native
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionMetadata, CpuAttentionBackend, build_group
from densa.model.fused_decode import FusedDecoder, unsupported_reason
from densa.model.kv_pages import allocate_kv_caches
from densa.model.loader import load_model
from densa.model.packed_linear import PackedLinear, ShardedPackedLinear
from densa.model.quantized_embedding import GGUFEmbedding
from densa.utils.cpu import cpu_flags

pytestmark = pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")

PAGE_SIZE = 4
FP32 = KVFormat.of("float32")
PATHS = ["avx2"] + (
    ["avx512_vnni"] if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags() else []
)
KV_FORMATS = {  # name: (KV format, static scales)
    "fp32": (KVFormat.of("float32"), None),
    "bf16": (KVFormat.of("bfloat16"), None),
    "fp8-dynamic": (KVFormat.of("fp8_e4m3", "dynamic"), None),
    "fp8-static": (
        KVFormat.of("fp8_e4m3", "static"),
        fp8_kv.KVScales(k=(0.5, 0.25), v=(0.125, 1.0)),
    ),
    "int8": (KVFormat.of("int8"), None),
}


@pytest.fixture(scope="module")
def biased_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny Qwen2 (q/k/v biases) with SmolLM2's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


# Three prompts (lengths, page tables): pages are scattered and shared by no one.
SHORT_PROMPTS = ([7, 13, 4], [[30, 2, 17, 9], [5, 33, 21, 11, 26], [14, 38]])


def _step(
    model_dir: Path,
    weight_format: str,
    kv: str,
    head_format: str = "dense",
    prompts: tuple[list[int], list[list[int]]] = SHORT_PROMPTS,
    convert: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Prefill the prompts eagerly, then run one decode step eagerly and fused from copies
    of the same caches; returns (eager hidden, fused hidden, [(eager cache, fused cache)]).
    `convert` changes the loaded model's layers first."""
    arch = ArchConfig.from_dir(model_dir)
    cpu = torch.device("cpu")
    model = load_model(model_dir, arch, "float32", 512, cpu, weight_format, head_format)
    if convert is not None:
        convert(model)
    kv_format, static = KV_FORMATS[kv]
    lens, tables = prompts
    num_pages = max(max(table) for table in tables) + 1
    caches = allocate_kv_caches(arch, num_pages, PAGE_SIZE, kv_format, cpu, static)
    backend = CpuAttentionBackend()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for length, table in zip(lens, tables, strict=True):
            ids = torch.randint(300, 40000, (length,), generator=gen)
            pos = torch.arange(length)
            meta = AttentionMetadata(
                slot_pages=torch.tensor([table[p // PAGE_SIZE] for p in range(length)]),
                slot_offsets=pos % PAGE_SIZE,
                decode=None,
                prefill=build_group(0, [table], [length], [length], PAGE_SIZE, cpu),
            )
            model(ids, pos, caches, meta, backend)
        ids = torch.randint(300, 40000, (len(lens),), generator=gen)
        pos = torch.tensor(lens)
        meta = AttentionMetadata(
            slot_pages=torch.tensor([t[p // PAGE_SIZE] for t, p in zip(tables, lens, strict=True)]),
            slot_offsets=pos % PAGE_SIZE,
            decode=build_group(0, tables, [n + 1 for n in lens], [1] * len(lens), PAGE_SIZE, cpu),
            prefill=None,
        )
        fused_caches = [_copy(c) for c in caches]
        assert unsupported_reason(model, fused_caches) is None
        fused = FusedDecoder(model, fused_caches).forward(ids, pos, meta)
        eager = model(ids, pos, caches, meta, backend)
    return eager, fused, list(zip(caches, fused_caches, strict=True))


def _copy(cache):  # type: ignore[no-untyped-def]
    from densa.model.attention import LayerKVCache

    def clone(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    return LayerKVCache(
        cache.k.clone(), cache.v.clone(), clone(cache.k_scale), clone(cache.v_scale)
    )


def _assert_same_pages(pairs: list) -> None:
    for eager, fused in pairs:
        for a, b in ((eager.k, fused.k), (eager.v, fused.v)):
            if a.dtype == torch.float32:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            else:  # narrow caches: the same bytes, whatever rounding happened before the store
                mismatch = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
                assert mismatch < 0.01, f"{mismatch:.2%} of the stored bytes differ"
        for a, b in ((eager.k_scale, fused.k_scale), (eager.v_scale, fused.v_scale)):
            if a is not None and a.dim() > 0:
                assert (a != b).float().mean().item() < 0.01


@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("kv", list(KV_FORMATS))
@pytest.mark.parametrize("weight_format", ["dense", "w4a8", "w8a8", "w8"])
def test_fused_step_matches_eager(
    forced_isa: str, kv: str, weight_format: str, tiny_model_dir: Path
) -> None:
    eager, fused, pairs = _step(tiny_model_dir, weight_format, kv)
    torch.testing.assert_close(fused, eager, **_tolerance(kv))
    _assert_same_pages(pairs)


@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("weight_format", ["mxfp4", "nvfp4", "mxfp4a8", "nvfp4a8"])
def test_fused_step_runs_fp4_weights(
    forced_isa: str, weight_format: str, tiny_model_dir: Path
) -> None:
    """FP4 layers (quantized at load: weight-only or int8 activations) in the fused step."""
    eager, fused, pairs = _step(tiny_model_dir, weight_format, "fp32")
    torch.testing.assert_close(fused, eager, **_tolerance("fp32"))
    _assert_same_pages(pairs)


def test_context_splits_balance_the_threads() -> None:
    splits = native.load().context_splits
    assert splits(3, 2, 330) == 2  # 3 kv heads on 2 threads: 1.5 head-contexts per thread, not 2
    assert splits(1, 2, 600) == 2  # one kv head: both threads take half
    assert splits(96, 2, 330) == 1  # a batch already spreads evenly
    assert splits(3, 2, 200) == 1  # parts under 128 tokens cost more to merge than they save
    assert splits(2, 2, 4000) == 1


@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_fused_step_over_a_split_context(forced_isa: str, kv: str, tiny_model_dir: Path) -> None:
    """One 301-token context on 4 threads: each kv head's context is cut into page-aligned parts
    whose partial softmaxes are merged (context_splits(2, 4, 301) = 2), as eager computes it whole.
    Dense weights: with int8 activations a last-bit difference in the attention's output can flip
    one activation's rounding before o_proj, which would hide what this test checks."""
    assert native.load().context_splits(2, 4, 301) == 2
    length = 300
    table = [(7 * p) % 97 for p in range(length // PAGE_SIZE + 1)]  # scattered, distinct (97 prime)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        eager, fused, pairs = _step(tiny_model_dir, "dense", kv, prompts=([length], [table]))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(fused, eager, **_tolerance(kv))
    _assert_same_pages(pairs)


def _tolerance(kv: str) -> dict[str, float]:
    """fp32 summation order differs between the paths; on an fp8 cache that can flip the
    rounding of a stored value now and then (one e4m3 step is 6%), which moves the output by
    ~1e-3. Every stored byte is still compared above."""
    narrow = kv.startswith("fp8") or kv == "int8"
    return {"rtol": 1e-2, "atol": 3e-3} if narrow else {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize("forced_isa", PATHS[-1:], indirect=True)
def test_fused_step_with_qkv_bias(forced_isa: str, biased_model_dir: Path) -> None:
    eager, fused, pairs = _step(biased_model_dir, "w8a8", "fp8-dynamic")
    torch.testing.assert_close(fused, eager, **_tolerance("fp8-dynamic"))
    _assert_same_pages(pairs)


def _split_formats_with_sharded_qkv(model: torch.nn.Module) -> None:
    """gate|up in w5a8 (Q5_0 tensors), o in w5ma8 (Q5_K), down in w6ma8, and q|k|v in three
    shards: q in w4a8, k in w8a8 and v in w6a8 (as a GGUF file whose v is Q6_K loads), with the
    bias over all three."""
    for layer in getattr(model, "layers"):  # noqa: B009
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name, fmt in (
            (attn, "o_proj", "w5ma8"), (mlp, "gate_up_proj", "w5a8"), (mlp, "down_proj", "w6ma8")
        ):  # fmt: skip
            dense = getattr(owner, name)
            setattr(owner, name, PackedLinear(fmt, dense.weight, dense.bias))
        qkv = attn.qkv_proj
        parts = qkv.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        formats = ("w4a8", "w8a8", "w6a8")
        shards = [PackedLinear(f, w, None) for f, w in zip(formats, parts, strict=True)]
        attn.qkv_proj = ShardedPackedLinear(shards, qkv.bias)


@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("kv", ["fp32", "fp8-dynamic"])
@pytest.mark.parametrize("biased", [False, True])
def test_fused_step_with_split_formats_and_sharded_qkv(
    forced_isa: str, kv: str, biased: bool, tiny_model_dir: Path, biased_model_dir: Path
) -> None:
    model_dir = biased_model_dir if biased else tiny_model_dir
    eager, fused, pairs = _step(model_dir, "dense", kv, convert=_split_formats_with_sharded_qkv)
    torch.testing.assert_close(fused, eager, **_tolerance(kv))
    _assert_same_pages(pairs)


def _quantized_embedding(model: torch.nn.Module) -> None:
    """The embedding as a GGUF Q8_0 table (rows decoded at lookup, as a GGUF file keeps it)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    dense = getattr(model, "embed_tokens").weight.detach().numpy()  # noqa: B009
    blocks = quantize(dense, GGMLQuantizationType.Q8_0)
    table = GGUFEmbedding("Q8_0", dense.shape[0], dense.shape[1], blocks.shape[1])
    table.blocks.copy_(torch.from_numpy(blocks))
    setattr(model, "embed_tokens", table)  # noqa: B010


@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
def test_fused_step_with_a_quantized_embedding(forced_isa: str, tiny_model_dir: Path) -> None:
    """The C++ step takes the rows the GGUF table decodes instead of indexing a float table."""
    eager, fused, pairs = _step(tiny_model_dir, "w4a8", "fp32", convert=_quantized_embedding)
    torch.testing.assert_close(fused, eager, **_tolerance("fp32"))
    _assert_same_pages(pairs)


def test_unsupported_models_say_why(tiny_model_dir: Path) -> None:
    arch = ArchConfig.from_dir(tiny_model_dir)
    cpu = torch.device("cpu")
    model = load_model(tiny_model_dir, arch, "bfloat16", 64, cpu)
    caches = allocate_kv_caches(arch, 4, PAGE_SIZE, KVFormat.of("bfloat16"), cpu)
    assert unsupported_reason(model, caches) == "compute dtype is not float32"
    int4 = load_model(tiny_model_dir, arch, "float32", 64, cpu, "int4")
    assert "Int4Linear" in str(unsupported_reason(int4, caches))


def _mixed_meta(cpu: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A mixed step: two decode rows (contexts of 5 and 9) and a 6-token prefill chunk that
    continues a 3-token prefix (positions 3..8), pages scattered."""
    tables = [[7, 1], [4, 12, 20], [15, 3, 9]]
    positions = [4, 8, 3, 4, 5, 6, 7, 8]
    rows_table = [0, 1, 2, 2, 2, 2, 2, 2]
    pos = torch.tensor(positions)
    meta = AttentionMetadata(
        slot_pages=torch.tensor(
            [tables[r][p // PAGE_SIZE] for r, p in zip(rows_table, positions, strict=True)]
        ),
        slot_offsets=pos % PAGE_SIZE,
        decode=build_group(0, tables[:2], [5, 9], [1, 1], PAGE_SIZE, cpu),
        prefill=build_group(2, tables[2:], [9], [6], PAGE_SIZE, cpu),
    )
    ids = torch.randint(300, 40000, (len(positions),), generator=torch.Generator().manual_seed(3))
    return ids, pos, meta


@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("kv", ["fp32", "fp8-dynamic", "int8"])
@pytest.mark.parametrize("weight_format", ["dense", "w4a8"])
def test_layered_steps_match_eager(
    forced_isa: str, kv: str, weight_format: str, tiny_model_dir: Path
) -> None:
    """Prefill and mixed steps: two C++ calls per layer around the attention backend."""
    arch = ArchConfig.from_dir(tiny_model_dir)
    cpu = torch.device("cpu")
    model = load_model(tiny_model_dir, arch, "float32", 512, cpu, weight_format)
    kv_format, static = KV_FORMATS[kv]
    caches = allocate_kv_caches(arch, 24, PAGE_SIZE, kv_format, cpu, static)
    backend = CpuAttentionBackend()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        # Earlier context of the three sequences, eagerly: 4, 8 and 3 tokens.
        for table, length in (([7, 1], 4), ([4, 12, 20], 8), ([15, 3, 9], 3)):
            pos = torch.arange(length)
            meta = AttentionMetadata(
                slot_pages=torch.tensor([table[p // PAGE_SIZE] for p in range(length)]),
                slot_offsets=pos % PAGE_SIZE,
                decode=None,
                prefill=build_group(0, [table], [length], [length], PAGE_SIZE, cpu),
            )
            model(torch.randint(300, 40000, (length,), generator=gen), pos, caches, meta, backend)
        ids, pos, meta = _mixed_meta(cpu)
        layered_caches = [_copy(c) for c in caches]
        layered = FusedDecoder(model, layered_caches).forward_layers(model, ids, pos, meta, backend)
        eager = model(ids, pos, caches, meta, backend)
    torch.testing.assert_close(layered, eager, **_tolerance(kv))
    _assert_same_pages(list(zip(caches, layered_caches, strict=True)))


def _one_token_sequences(first: int, count: int, cpu: torch.device) -> AttentionMetadata:
    """`count` sequences of one token each (rows first.., sequence i on page i), as one
    decode group: each row stores its own K/V and attends to it alone."""
    pages = list(range(first, first + count))
    return AttentionMetadata(
        slot_pages=torch.tensor(pages),
        slot_offsets=torch.zeros(count, dtype=torch.long),
        decode=build_group(0, [[p] for p in pages], [1] * count, [1] * count, PAGE_SIZE, cpu),
        prefill=None,
    )


@pytest.mark.parametrize("weight_format", ["dense", "w4a8"])
def test_a_step_of_more_rows_than_an_mlp_tile_equals_its_rows_run_apart(
    weight_format: str, tiny_model_dir: Path
) -> None:
    """The MLP runs 128 rows at a time (decoder.cpp, kMlpTileRows: less memory per prefill
    chunk): 300 rows in one call give exactly what 100-row calls give for the same rows."""
    arch = ArchConfig.from_dir(tiny_model_dir)
    cpu = torch.device("cpu")
    model = load_model(tiny_model_dir, arch, "float32", 64, cpu, weight_format)
    num_rows, part = 300, 100
    ids = torch.randint(300, 40000, (num_rows,), generator=torch.Generator().manual_seed(5))
    pos = torch.zeros(num_rows, dtype=torch.long)
    with torch.inference_mode():
        caches = allocate_kv_caches(arch, num_rows, PAGE_SIZE, FP32, cpu)
        whole = FusedDecoder(model, caches).forward(
            ids, pos, _one_token_sequences(0, num_rows, cpu)
        )
        parts = []
        for first in range(0, num_rows, part):
            apart = allocate_kv_caches(arch, part, PAGE_SIZE, FP32, cpu)
            meta = _one_token_sequences(0, part, cpu)
            rows = slice(first, first + part)
            parts.append(FusedDecoder(model, apart).forward(ids[rows], pos[rows], meta))
    assert torch.equal(whole, torch.cat(parts))
