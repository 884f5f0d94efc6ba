"""The GPU path end to end, run on the CPU: the Triton attention backend (in Triton's
interpreter), its tag-check kernel and the decode-graph runner's padding and static buffers
(through EagerCapturer), inside a real engine. Greedy tokens must equal the CPU backends'.

device="cpu" stands in for "cuda" here: the builder places weights, KV pages and the tag table
on `args.device` whatever it is, and the Triton code takes the same path on both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from densa.engine.llm import LLM
from densa.model.attention import CpuAttentionBackend, TorchAttentionBackend
from densa.model.attention_backends import TritonAttentionBackend, select_backend
from densa.sampling_params import SamplingParams
from densa.sched.mirror import ScheduledRequest
from densa.worker.cuda_graphs import DecodeGraphs, EagerCapturer
from densa.worker.integrity import TritonTagTableChecker

SMALL = dict(num_kv_pages=40, page_size=4, max_model_len=48, max_num_batched_tokens=64)
PROMPTS = [[1, 500, 37, 9000, 12], [1, 77, 4242, 3, 3, 3, 108, 2001, 55], [1, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def test_backend_selection() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu), CpuAttentionBackend)
    assert isinstance(select_backend("triton", cpu), TritonAttentionBackend)
    assert isinstance(select_backend("auto", torch.device("cuda")), TritonAttentionBackend)
    assert isinstance(select_backend("torch", torch.device("cuda")), TorchAttentionBackend)
    with pytest.raises(ValueError, match="CPU only"):
        select_backend("cpu", torch.device("cuda"))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "fp8_e4m3"])
def test_triton_backend_generates_the_cpu_backends_tokens(
    tiny_model_dir: Path, kv_cache_dtype: str
) -> None:
    reference = LLM(str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype, **SMALL)
    triton = LLM(
        str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype, attention_backend="triton", **SMALL
    )
    runner = triton.engine.runner
    assert isinstance(runner.backend, TritonAttentionBackend)
    assert isinstance(runner.integrity, TritonTagTableChecker)
    assert runner.decode_graphs is None  # graphs are for GPUs; tests attach an eager one below
    assert _tokens(triton) == _tokens(reference)


def test_decode_graphs_pad_the_batch_and_write_only_real_slots(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), attention_backend="triton", **SMALL)
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, runner.backend, page_size=4, max_pages=12,
        device=torch.device("cpu"), batch_sizes=(1, 2, 4), capturer=EagerCapturer(),
    )  # fmt: skip
    assert [graphs.padded_size(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    plain = _tokens(llm)
    runner.decode_graphs = graphs
    steps: list[int] = []
    original = graphs.run

    def counting_run(items: list[ScheduledRequest]):  # type: ignore[no-untyped-def]
        steps.append(len(items))
        before = [c.k.clone() for c in runner.kv_caches]
        result = original(items)
        # Exactly one new slot per real row changed in every layer; padding wrote nothing.
        written = {(i.page_ids[i.start_pos // 4], i.start_pos % 4) for i in items}
        for cache, old in zip(runner.kv_caches, before, strict=True):
            changed = (cache.k != old).any(dim=(1, 3)).nonzero().tolist()  # [page, slot]
            assert {tuple(p) for p in changed} <= written
        buffers = graphs.buffers
        size = graphs.padded_size(len(items))
        assert buffers.slot_pages[len(items) : size].eq(-1).all()
        assert buffers.seq_lens[len(items) : size].eq(0).all()
        return result

    graphs.run = counting_run  # type: ignore[method-assign]
    assert _tokens(llm) == plain
    assert 3 in steps  # three decodes at once: padded to the captured size 4


def test_graphs_refuse_what_they_cannot_replay(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **SMALL)  # the CPU backend is not graph-safe
    runner = llm.engine.runner
    with pytest.raises(ValueError, match="cannot be captured"):
        DecodeGraphs(
            runner.model, runner.kv_caches, runner.backend, 4, 12, torch.device("cpu"),
            capturer=EagerCapturer(),
        )  # fmt: skip
