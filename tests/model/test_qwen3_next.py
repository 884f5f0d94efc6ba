"""Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated full attention) against transformers, tiny random:
greedy tokens of several requests batched together (decodes beside prefill chunks), with the
prompts prefilled in chunks of 1, 7, 64 tokens or whole, each request in its own state slot
(slots start full of garbage: a prompt's first chunk must start from zeros)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from densa.model.arch import ArchConfig
from densa.model.attention import (
    AttentionMetadata,
    LayerKVCache,
    TorchAttentionBackend,
    build_group,
)
from densa.model.gated_deltanet import LinearStateCache
from densa.model.kv_layout import HybridKVLayout
from densa.model.loader import load_model
from tests.tiny_families import save_tiny

PAGE, NUM_PAGES, NUM_SLOTS, MAX_NEW = 4, 64, 5, 6
PROMPT_LENS = (3, 70, 11)  # 70: more than one 64-token chunk
SHORT = 20  # token-by-token and 7-token chunks run the long prompt cut to this (test time)


@dataclass
class Seq:
    prompt: list[int]
    pages: list[int]
    slot: int
    done: int = 0  # tokens whose K/V and state are in the cache
    out: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@pytest.fixture(scope="module", params=["qwen3_next"])
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]], list[list[int]]]:
    family = request.param
    model_dir = save_tiny(family, tmp_path_factory.mktemp(family), seed=2)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts.append(prompts[1][:SHORT])
    return model_dir, prompts, _hf_greedy(model_dir, prompts)


def _hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                min_new_tokens=MAX_NEW,
            )
            outs.append(ids[0, len(prompt) :].tolist())
    return outs


def _caches(arch: ArchConfig) -> list[LayerKVCache | LinearStateCache]:
    assert arch.linear is not None
    lin, gen = arch.linear, torch.Generator().manual_seed(1)
    caches: list[LayerKVCache | LinearStateCache] = []
    for i in range(arch.num_layers):
        if lin.is_linear_layer(i):
            conv = torch.randn(NUM_SLOTS, lin.conv_dim, lin.conv_kernel - 1, generator=gen)
            shape = (NUM_SLOTS, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)
            caches.append(LinearStateCache(conv, torch.randn(shape, generator=gen)))
        else:
            shape = (NUM_PAGES, arch.num_kv_heads, PAGE, arch.head_dim)
            caches.append(LayerKVCache(k=torch.zeros(shape), v=torch.zeros(shape)))
    return caches


def _step(
    seqs: list[Seq], chunk: int
) -> tuple[list[Seq], list[tuple[Seq, int]], AttentionMetadata, torch.Tensor, torch.Tensor]:
    """This step's rows: every decoding request's next token, then each prefilling request's
    next chunk; and which rows sample for which request."""
    decodes = [s for s in seqs if s.done >= len(s.prompt) and len(s.out) < MAX_NEW]
    prefills = [s for s in seqs if s.done < len(s.prompt)]
    ids, positions, samples = [], [], []
    spans = [(s, s.done, s.done + 1) for s in decodes]
    spans += [(s, s.done, min(s.done + chunk, len(s.prompt))) for s in prefills]
    for s, lo, hi in spans:
        ids += s.tokens[lo:hi]
        positions += list(range(lo, hi))
        if hi >= len(s.prompt):
            samples.append((s, len(ids) - 1))
    pos = torch.tensor(positions)
    slot_pages = torch.tensor([s.pages[p // PAGE] for s, lo, hi in spans for p in range(lo, hi)])

    def group(start: int, part: list[tuple[Seq, int, int]]):  # type: ignore[no-untyped-def]
        if not part:
            return None
        return build_group(start, [s.pages for s, _, _ in part], [hi for _, _, hi in part],
                           [hi - lo for _, lo, hi in part], PAGE, torch.device("cpu"))  # fmt: skip

    meta = AttentionMetadata(
        slot_pages=slot_pages, slot_offsets=pos % PAGE,
        decode=group(0, spans[: len(decodes)]), prefill=group(len(decodes), spans[len(decodes) :]),
        state_slot_ids=torch.tensor([s.slot for s, _, _ in spans]),
    )  # fmt: skip
    for s, _, hi in spans:
        s.done = hi
    return decodes, samples, meta, torch.tensor(ids), pos


def _densa_greedy(model_dir: Path, prompts: list[list[int]], chunk: int) -> list[list[int]]:
    arch = ArchConfig.from_dir(model_dir)
    model = load_model(model_dir, arch, "float32", 256, torch.device("cpu"))
    caches = _caches(arch)
    # pages spread out and interleaved between requests; slots out of order
    seqs = [Seq(p, list(range(NUM_PAGES - 1 - i, -1, -3))[:32], slot) for i, (p, slot) in
            enumerate(zip(prompts, (4, 0, 2), strict=True))]  # fmt: skip
    while any(len(s.out) < MAX_NEW for s in seqs):
        _, samples, meta, ids, pos = _step(seqs, chunk)
        with torch.inference_mode():
            hidden = model(ids, pos, caches, meta, TorchAttentionBackend())
        if not samples:  # only prefill chunks that end inside their prompts
            continue
        with torch.inference_mode():
            rows = torch.tensor([row for _, row in samples])
            next_ids = model.compute_logits(hidden[rows]).argmax(-1).tolist()  # type: ignore[operator]
        for (s, _), token in zip(samples, next_ids, strict=True):
            s.out.append(token)
    return [s.out for s in seqs]


# Qwen3.5 shares the stack: one chunked and one whole-prompt run each.
RUNS = [("qwen3_next", c) for c in (1, 7, 64, 1000)]
RUNS += [(family, c) for family in ("qwen3_5", "qwen3_5_moe") for c in (7, 1000)]


@pytest.mark.parametrize(("case", "chunk"), RUNS, indirect=["case"])
def test_greedy_tokens_equal_transformers_batched_and_chunked(case, chunk: int) -> None:  # type: ignore[no-untyped-def]
    model_dir, prompts, want = case
    picked = [0, 1, 2] if chunk >= 64 else [0, 3, 2]
    got = _densa_greedy(model_dir, [prompts[i] for i in picked], chunk)
    assert got == [want[i] for i in picked]


def test_the_hybrid_layout_pages_only_full_layers_and_sizes_a_state_slot(case) -> None:  # type: ignore[no-untyped-def]
    arch = ArchConfig.from_dir(case[0])
    layout = HybridKVLayout()
    geo = layout.geometry(arch)
    assert (geo.num_layers, geo.num_parts, geo.num_heads, geo.head_dim) == (1, 2, 2, 16)
    state = layout.state_geometry(arch)
    # 3 linear layers; conv: (2 * 2*8 + 4*8) channels x 3 inputs; recurrent: 4 heads x 8 x 8
    assert (state.num_layers, state.conv_values, state.recurrent_values) == (3, 64 * 3, 256)
    assert state.slot_bytes(2) == 3 * (64 * 3 * 2 + 256 * 4)
    assert arch.rotary_dim == 4


def test_the_engine_refuses_a_hybrid_model_before_loading_it(case) -> None:  # type: ignore[no-untyped-def]
    from densa.engine.llm_engine import LLMEngine
    from densa.model.arch import ModelLoadError
    from densa.setup.args import EngineArgs

    with pytest.raises(ModelLoadError, match=r"hybrid model .* state slots"):
        LLMEngine.from_args(EngineArgs(model=str(case[0]), max_model_len=64, num_kv_pages=16))
