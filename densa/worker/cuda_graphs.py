"""Decode steps replayed from CUDA graphs: one graph per captured batch size, static input
buffers, and padding of a step's batch up to the next captured size.

A decode step of a small model on a GPU is mostly kernel launches (hundreds per step, a few
microseconds each) rather than arithmetic; a graph replays them all in one launch. What a graph
needs: every tensor it reads sits at a fixed address (the static buffers below, refilled before
each replay), and nothing inside it depends on tensor values for its shapes or talks to the
host. The Triton attention backend is built that way (it declares `supports_cuda_graphs`); its
decode kernel sizes its split grid by the page table's width, so one graph serves any context up
to `max_pages`.

Padding rows (batch n padded to captured size B) are inert:

    rows      0 .. n-1                         n .. B-1
    token     the request's last token         0
    position  its position                     0
    slot      its page and offset              page -1: the KV store skips it, writes nowhere
    context   seq_len, its page table row      seq_len 0: attention returns zeros
    logits    sampled                          dropped

The scheduler stays on the CPU; the runner hands each all-decode step it can serve to
`DecodeGraphs.run` (see ModelRunner._run). Capturing is behind `GraphCapturer`, so the padding
and buffer logic runs on the CPU in tests with `EagerCapturer` (replay = run the same code over
the same static buffers).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from densa.model.attention import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    LayerKVCache,
)
from densa.model.interface import CausalLM
from densa.sched.mirror import ScheduledRequest
from densa.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)

Step = Callable[[], torch.Tensor]


class GraphCapturer(Protocol):
    """Turns a step over static buffers into something to replay. `capture` may run the step."""

    def capture(self, step: Step) -> Step: ...


class EagerCapturer:
    """No graph: replaying runs the step again. For CPU tests of the buffer logic."""

    def capture(self, step: Step) -> Step:
        return step


class CudaGraphCapturer:
    """torch.cuda.CUDAGraph capture; all graphs share one memory pool (captured largest first,
    smaller ones reuse its blocks), so their intermediates cost one batch's worth of memory."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Step) -> Step:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class DecodeGraphs:
    """Captured decode steps of `model` over `kv_caches` for each size in `batch_sizes`."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[LayerKVCache],
        backend: AttentionBackend,
        page_size: int,
        max_pages: int,
        device: torch.device,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        capturer: GraphCapturer | None = None,
    ) -> None:
        if not backend.capabilities.supports_cuda_graphs:
            raise ValueError(f"the {backend.name!r} attention backend cannot be captured in graphs")
        self.model = model
        self.page_size = page_size
        self.max_pages = max_pages  # page-table width: contexts up to max_pages * page_size
        self.batch_sizes = sorted(set(batch_sizes))
        max_batch = self.batch_sizes[-1]
        self.buffers = _StaticBuffers(max_batch, max_pages, device)
        self.capturer = capturer or CudaGraphCapturer()
        self._steps: dict[int, Step] = {}
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):  # largest first: the pool grows once
                self._steps[size] = self._capture(size, model, kv_caches, backend)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds num_seqs rows."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    def can_run(self, items: list[ScheduledRequest]) -> bool:
        """All decode rows (one token each, nothing to verify), few enough, each context within
        the table width."""
        return (
            0 < len(items) <= self.max_batch_size
            and all(item.is_decode and not item.num_spec for item in items)
            and all(-(-item.end_pos // self.page_size) <= self.max_pages for item in items)
        )

    def run(
        self, items: list[ScheduledRequest]
    ) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """One decode step: (the sampling requests, their logits [N, vocab] float32, or None
        when no row samples: one-token prompt chunks)."""
        size = self.padded_size(len(items))
        self.buffers.fill(items, self.page_size, size)
        logits = self._steps[size]()  # [size, vocab]
        rows = [i for i, item in enumerate(items) if item.sample]
        if not rows:
            return [], None
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        return [items[i] for i in rows], logits[index]

    def _capture(
        self, size: int, model: CausalLM, kv_caches: list[LayerKVCache], backend: AttentionBackend
    ) -> Step:
        buffers = self.buffers
        meta = buffers.metadata(size)
        input_ids, positions = buffers.input_ids[:size], buffers.positions[:size]

        def step() -> torch.Tensor:
            hidden = model(input_ids, positions, kv_caches, meta, backend)
            return model.compute_logits(hidden)

        buffers.clear(size)  # inert rows only: warm-up and capture write no KV
        step()  # warm-up: compiles the kernels and fixes the matmul configs before capture
        return self.capturer.capture(step)


class _StaticBuffers:
    """The tensors every captured step reads, at fixed addresses, for up to max_batch rows."""

    def __init__(self, max_batch: int, max_pages: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_pages = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.page_table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.valid = torch.ones(max_batch, dtype=torch.bool, device=device)
        # Host-side staging: one [rows, 5 + max_pages] int64 block per step, copied in one go.
        pinned = device.type == "cuda"
        self.staging = torch.zeros(max_batch, 5 + max_pages, dtype=torch.int64, pin_memory=pinned)
        # The copy out of `staging` is asynchronous: the next fill waits for it first.
        self.copied = torch.cuda.Event() if pinned else None

    def metadata(self, size: int) -> AttentionMetadata:
        group = AttentionGroup(
            start=0,
            end=size,
            page_table=self.page_table[:size],
            seq_lens=self.seq_lens[:size],
            query_lens=self.query_lens[:size],
            max_query_len=1,
            valid=self.valid[:size],
            # The padded-SDPA mask is the torch backend's; graph-safe backends never read it.
            mask=torch.empty(size, 1, 1, 0, dtype=torch.bool, device=self.valid.device),
        )
        return AttentionMetadata(
            slot_pages=self.slot_pages[:size],
            slot_offsets=self.slot_offsets[:size],
            decode=group,
            prefill=None,
        )

    def clear(self, size: int) -> None:
        """Make rows 0..size-1 padding rows."""
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.slot_pages[:size] = -1
        self.slot_offsets[:size] = 0
        self.page_table[:size] = 0
        self.seq_lens[:size] = 0

    def fill(self, items: list[ScheduledRequest], page_size: int, size: int) -> None:
        """Rows for `items`, then padding rows up to `size` (see the module docstring)."""
        if self.copied is not None:
            self.copied.synchronize()
        host = self.staging[:size]
        host.zero_()
        host[:, 2] = -1  # padding slots: page -1
        for row, item in enumerate(items):
            position = item.start_pos
            num_pages = -(-item.end_pos // page_size)
            host[row, 0] = item.token_ids[0]
            host[row, 1] = position
            host[row, 2] = item.page_ids[position // page_size]
            host[row, 3] = position % page_size
            host[row, 4] = item.end_pos
            host[row, 5 : 5 + num_pages] = torch.tensor(item.page_ids[:num_pages])
        device_rows = host.to(self.input_ids.device, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.input_ids[:size] = device_rows[:, 0]
        self.positions[:size] = device_rows[:, 1]
        self.slot_pages[:size] = device_rows[:, 2]
        self.slot_offsets[:size] = device_rows[:, 3]
        self.seq_lens[:size] = device_rows[:, 4].to(torch.int32)
        self.page_table[:size] = device_rows[:, 5:].to(torch.int32)
