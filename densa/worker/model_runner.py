"""Runs one scheduled step: build the flattened batch, run the model over paged KV, sample.

Input:  a SchedulerOutput (plain data).  Output: a RunnerOutput (plain data).
The runner owns the KV tensors and the sampler's per-request RNG state, nothing else; the step
is the one way in to them. K/V copied in (a prefill worker's pages, a KV tier's blocks) arrives
in the step (KVLanding) and is written before the step reads any page; pages copied out (on
their way to a KV tier, or to a decode worker) are asked for in the step too (KVExport) and
come back in its output, packed before the step writes any page; both through worker/kv_io.py.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from densa.formats.kv_format import KVFormat
from densa.model.attention import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    LayerKVCache,
    build_group,
)
from densa.model.fused_decode import FusedDecoder
from densa.model.interface import CausalLM
from densa.model.kv_layout import LayerCache
from densa.sched.mirror import RequestStates, ScheduledRequest, UnknownRequest
from densa.sched.output import PackedPages, SchedulerOutput
from densa.sched.stop import StopRule
from densa.utils.logging import get_logger
from densa.worker import kv_io
from densa.worker.confinement import compute_confined
from densa.worker.cuda_graphs import DecodeGraphs
from densa.worker.grammar import GrammarCompiler
from densa.worker.integrity import IntegrityChecker
from densa.worker.kv_amax import AmaxObserver, observing_kv
from densa.worker.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from densa.worker.sampler import Sampler, SampleRequest
from densa.worker.step_intake import Begun, export_pages, land_pages
from densa.worker.step_output import RunnerOutput
from densa.worker.structured import StructuredSampler

logger = get_logger(__name__)

# Rows of logits alive at once while a step samples: a [64, 151936] float32 block is 37 MiB,
# [16, ...] 9 MiB. The output head streams its weights once per call whatever its row count, so
# each further block of rows reads them again (~5 ms for the 1.5B's head): a step of <= 16
# sampling rows computes them as before, one of 64 reads the head 4 times.
LOGITS_ROWS_AT_ONCE = 16


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # requests in row order (decodes first)
    # [N] rows whose logits are sampled: the last token of each sampling request, and before it
    # the rows of the proposals it verifies (1 + num_spec rows per request).
    sample_rows: torch.Tensor
    samplers: list[ScheduledRequest]  # the sampling requests, in sample_rows order


@dataclass(frozen=True)
class PassLogits:
    """A forward pass's sampling requests and their logits, computed on demand for a range of
    their rows (`rows(start, end)`: [end - start, vocab] float32) so that sampling never needs
    every row's logits at once. Request i owns rows [offsets[i], offsets[i + 1])."""

    samplers: list[ScheduledRequest]
    rows: Callable[[int, int], torch.Tensor]
    # Computed with the pass (from its hidden states, which are not kept): see RunnerOutput.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)

    @property
    def offsets(self) -> list[int]:
        offsets = [0]
        for item in self.samplers:
            offsets.append(offsets[-1] + 1 + item.num_spec)
        return offsets


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[LayerCache],
        page_size: int,
        backend: AttentionBackend,
        stop_rule: StopRule,
        device: torch.device,
        integrity: IntegrityChecker,
        seed: int = 0,
        decode_model: CausalLM | None = None,
        decode_graphs: DecodeGraphs | None = None,
        grammars: GrammarCompiler | None = None,
        decodes_apart: bool = False,
        keeps_hidden: bool = False,
    ) -> None:
        self.model = model
        # Phase-aware weights: decode rows run through decode_model (e.g. INT4), prefill rows
        # through `model`; both read and write the same KV caches. None: one set for both.
        self.decode_model = decode_model
        # Decode rows in a pass of their own even with one set of weights: set when decode-only
        # passes take their own code path (the fused C++ step), so that a decode row computes
        # the same whether or not prefill chunks share its step (docs/architecture.md).
        self.decodes_apart = decodes_apart or decode_model is not None
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.backend = backend
        self.stop_rule = stop_rule  # the scheduler's stop rule: min_tokens keeps its tokens out
        self.device = device
        self.integrity = integrity
        # Compiles constraints (structured outputs, tool calls); None: unconstrained only.
        self.grammars = grammars
        self.sampler = Sampler(seed, StructuredSampler(grammars) if grammars else None)
        # CUDA graphs of all-decode steps through one of the models (None: always eager).
        self.decode_graphs = decode_graphs
        # The runner's mirror of each running request, kept from the scheduler's deltas.
        self.requests = RequestStates()
        # Whether the proposer reads the target's hidden states (an MTP layer does).
        self.keeps_hidden = keeps_hidden
        self._step_hidden: dict[str, torch.Tensor] = {}

    @property
    def kv_format(self) -> KVFormat:
        """How the pages store their values."""
        return kv_io.cache_format(self.kv_caches)

    def page_template(self) -> PackedPages:
        """No page, packed: the format, scales and shape every export of this runner has."""
        return kv_io.pack(self.kv_caches, [])

    def observing_kv(self) -> contextlib.AbstractContextManager[AmaxObserver]:
        """Record every layer's max |K| and |V| as steps store them, while inside (static FP8
        scales are calibrated so: worker/kv_amax.py)."""
        return observing_kv(self)

    def fused_decoder(self) -> FusedDecoder | None:
        """The fused C++ step of the (prefill) weights over these pages; None where it is off
        (for profiling its forward alone: densa_bench/speculative/step_split.py)."""
        switch = self.model.fused_decode
        caches = [c for c in self.kv_caches if isinstance(c, LayerKVCache)]
        return None if switch is None else switch.decoder_for(self.model, caches)

    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        """Take in the step's deltas once, then compute it; a computation that raises fails only
        the requests that cause it (worker/confinement.py)."""
        begun = self.begin(step)
        output = compute_confined(self.compute, begun.items, set(step.new_request_ids))
        output.errors.update(begun.errors)
        output.exported, output.refused_landings = begun.exported, begun.refused_landings
        return output

    def begin(self, step: SchedulerOutput) -> Begun:
        """Apply the step's deltas (tags, exports, landed K/V, ended and new requests, pages)
        exactly once: the chunks resolved to full views, the exported pages, and the requests
        that failed on their own (a chunk that could not be resolved, a landing refused or that
        could not be written)."""
        for request_id in step.finished_request_ids:
            self.sampler.forget(request_id)
        self.integrity.apply_tag_updates(step.tag_updates)
        begun = Begun(exported=export_pages(self.kv_caches, step.kv_exports))  # before writes
        land_pages(self.kv_caches, step.kv_landings, self.integrity, self.sampler, begun)
        self.requests.apply_lifecycle(step)
        for chunk in step.scheduled:
            try:
                begun.items.append(self.requests.resolve(chunk))
            except UnknownRequest as exc:  # a broken delta: that request alone cannot run
                begun.errors[chunk.request_id] = f"engine_error: {exc}"
        return begun

    @torch.inference_mode()
    def compute(self, items: list[ScheduledRequest]) -> RunnerOutput:
        """Check the pages' tags, run the forward pass, sample. Touches no bookkeeping, so a
        failed compute can be re-run on a subset (worker/confinement.py)."""
        started = time.perf_counter()
        failed = self.integrity.check_step(items)
        output = RunnerOutput(failed=failed, integrity_check_s=time.perf_counter() - started)
        scheduled = [s for s in items if s.request_id not in failed]
        if not scheduled:
            return output
        sampling = [self._sample_request(item) for item in scheduled if item.sample]
        saved = self.sampler.save_rng(sampling)  # all or nothing, as one Sampler.sample call
        try:
            if any(row.params.structured is not None for row in sampling):
                passes = list(self._forward(scheduled))
                self._sample_at_once(passes, output)
                for one_pass in passes:
                    output.prompt_logprobs.update(one_pass.prompt_logprobs)
            else:
                for one_pass in self._forward(scheduled):
                    self._sample_in_blocks(one_pass, output)
                    output.prompt_logprobs.update(one_pass.prompt_logprobs)
        except BaseException:
            self.sampler.restore_rng(saved)
            self._step_hidden = {}
            raise
        output.hidden, self._step_hidden = self._step_hidden, {}
        return output

    def _forward(self, scheduled: list[ScheduledRequest]) -> Iterator[PassLogits]:
        """Run the step through the weights of each row's phase, decode rows in a pass of their
        own when `decodes_apart`: each pass's sampling requests and their logits, yielded once
        the pass has run."""
        if not self.decodes_apart:
            yield self._run(self.model, scheduled)
            return
        # A decode step computes one generated token; a one-token chunk of a prompt is prefill.
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for item in scheduled:
            (decodes if item.is_decode else prefills).append(item)
        # Two passes over disjoint requests (each writes only its own KV slots), so their order
        # does not matter; decode rows first, as in a mixed batch.
        for model, items in ((self.decode_model or self.model, decodes), (self.model, prefills)):
            if items:
                yield self._run(model, items)

    def _run(self, model: CausalLM, items: list[ScheduledRequest]) -> PassLogits:
        graphs = self.decode_graphs
        # A replayed graph returns logits only: a step whose hidden states are kept runs eagerly.
        if (
            graphs is not None
            and model is graphs.model
            and graphs.can_run(items)
            and not (self.keeps_hidden)
        ):
            samplers, logits = graphs.run(items)  # logits is None only when none samples
            return PassLogits(samplers, lambda start, end: _rows_of(logits, start, end))
        inputs = self.prepare_inputs(items)
        hidden = model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend
        )
        if self.keeps_hidden:
            self._keep_hidden(inputs.order, hidden)
        prompt_logprobs = compute_prompt_logprobs(model, inputs.order, hidden)
        sample_hidden = hidden[inputs.sample_rows]  # [N, hidden]: a few KiB per row
        return PassLogits(
            inputs.samplers,
            lambda start, end: model.compute_logits(sample_hidden[start:end]),
            prompt_logprobs,
        )

    def _keep_hidden(self, order: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Each request's rows of the pass's hidden states (rows follow `order`)."""
        start = 0
        for item in order:
            self._step_hidden[item.request_id] = hidden[start : start + item.num_tokens]
            start += item.num_tokens

    @torch.inference_mode()
    def score(self, step: SchedulerOutput) -> torch.Tensor:
        """Logits for every token of the step's one chunk ([num_tokens, vocab], fp32): row i
        predicts the token after chunk.token_ids[i]. K/V is written and read exactly as in
        generation, so the cache format's effect on the distributions is what gets measured."""
        begun = self.begin(step)
        if begun.errors:
            raise RuntimeError(next(iter(begun.errors.values())))
        (item,) = begun.items
        violation = self.integrity.check_step([item]).get(item.request_id)
        if violation is not None:
            raise RuntimeError(violation.message)
        inputs = self.prepare_inputs([item])
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend
        )
        return self.model.compute_logits(hidden)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        decodes = [s for s in scheduled if s.is_decode]
        prefills = [s for s in scheduled if not s.is_decode]
        order = decodes + prefills
        token_ids: list[int] = []
        positions: list[int] = []
        slot_pages: list[int] = []
        sample_rows: list[int] = []
        for item in order:
            token_ids.extend(item.token_ids)
            item_positions = range(item.start_pos, item.end_pos)
            positions.extend(item_positions)
            slot_pages.extend(item.page_ids[p // self.page_size] for p in item_positions)
            if item.sample:
                sample_rows.extend(range(len(token_ids) - 1 - item.num_spec, len(token_ids)))
        positions_t = torch.tensor(positions, dtype=torch.long)
        meta = AttentionMetadata(
            slot_pages=torch.tensor(slot_pages, dtype=torch.long, device=self.device),
            slot_offsets=(positions_t % self.page_size).to(self.device),
            decode=self._decode_group(decodes),
            prefill=self._group(sum(item.num_tokens for item in decodes), prefills),
        )
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=positions_t.to(self.device),
            meta=meta,
            order=order,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            samplers=[item for item in order if item.sample],
        )

    def _decode_group(self, items: list[ScheduledRequest]) -> AttentionGroup | None:
        """One attention row per decode token. A request verifying k proposals brings 1 + k
        rows, and row j is attended exactly as the decode row at its position would be: its
        context ends at itself (seq_len = position + 1), so the decode kernels compute it as
        they compute any decode row, bit for bit (each layer stores every row's K/V before any
        row attends, so a row reads the rows before it from the pages)."""
        if not items:
            return None
        page_tables: list[list[int]] = []
        seq_lens: list[int] = []
        for item in items:
            pages = item.page_ids[: -(-item.end_pos // self.page_size)]
            for position in range(item.start_pos, item.end_pos):
                page_tables.append(pages)
                seq_lens.append(position + 1)
        return build_group(
            start=0,
            page_tables=page_tables,
            seq_lens=seq_lens,
            query_lens=[1] * len(seq_lens),
            page_size=self.page_size,
            device=self.device,
        )

    def _group(self, start: int, items: list[ScheduledRequest]) -> AttentionGroup | None:
        if not items:
            return None
        num_pages = [-(-item.end_pos // self.page_size) for item in items]
        return build_group(
            start=start,
            page_tables=[item.page_ids[:n] for item, n in zip(items, num_pages, strict=True)],
            seq_lens=[item.end_pos for item in items],
            query_lens=[item.num_tokens for item in items],
            page_size=self.page_size,
            device=self.device,
        )

    def _sample_in_blocks(self, one_pass: PassLogits, output: RunnerOutput) -> None:
        """Sample the pass's requests a block of whole requests at a time, computing the logits
        of that block's rows only (LOGITS_ROWS_AT_ONCE). A row's logits and token do not depend
        on the rows beside it (batch invariance), so the blocks give the tokens one block would."""
        offsets = one_pass.offsets
        for first, last in self._blocks(offsets):
            logits = one_pass.rows(offsets[first], offsets[last])
            self._sample_block(logits, one_pass.samplers[first:last], output)

    def _sample_at_once(self, passes: list[PassLogits], output: RunnerOutput) -> None:
        """Every row of the step in one Sampler.sample call: a step with a constrained request,
        whose grammar accepts its token inside that call (a later call's failure could not undo
        it, and the step is retried)."""
        passes = [one_pass for one_pass in passes if one_pass.samplers]
        logits = torch.cat([one_pass.rows(0, one_pass.offsets[-1]) for one_pass in passes])
        samplers = [item for one_pass in passes for item in one_pass.samplers]
        self._sample_block(logits, samplers, output)

    @staticmethod
    def _blocks(offsets: list[int]) -> Iterator[tuple[int, int]]:
        """[first, last) ranges of requests (request i owns rows [offsets[i], offsets[i + 1])),
        each with <= LOGITS_ROWS_AT_ONCE rows; a request with more rows is a block of its own."""
        num_requests = len(offsets) - 1
        first = 0
        for last in range(1, num_requests + 1):
            if last == num_requests or offsets[last + 1] - offsets[first] > LOGITS_ROWS_AT_ONCE:
                yield first, last
                first = last

    def _sample_request(self, item: ScheduledRequest) -> SampleRequest:
        params = item.sampling_params
        # Only a request still below min_tokens has its ending tokens masked (apply_min_tokens).
        below_min = len(item.output_token_ids) < params.min_tokens
        return SampleRequest(
            item.request_id,
            params,
            item.prompt_token_ids,
            item.output_token_ids,
            self.stop_rule.ending_tokens(params) if below_min else frozenset(),
            tuple(item.spec_token_ids),
        )

    def _sample_block(
        self, logits: torch.Tensor, samplers: list[ScheduledRequest], output: RunnerOutput
    ) -> None:
        rows = [self._sample_request(s) for s in samplers]
        result = self.sampler.sample(logits.cpu(), rows)
        for idx, (item, token_id, logprobs) in enumerate(
            zip(samplers, result.token_ids, result.logprobs, strict=True)
        ):
            if idx in result.failed:
                output.errors[item.request_id] = f"sampling_error: {result.failed[idx]}"
                continue
            output.sampled_token_ids[item.request_id] = token_id
            if logprobs is not None:
                output.logprobs[item.request_id] = logprobs
            if idx in result.accepted:
                output.accepted_token_ids[item.request_id] = result.accepted[idx]
            if idx in result.accepted_logprobs:
                output.accepted_logprobs[item.request_id] = result.accepted_logprobs[idx]
        output.errors.update(result.errors)


def _rows_of(logits: torch.Tensor | None, start: int, end: int) -> torch.Tensor:
    assert logits is not None, "a pass without sampling rows computes no logits"
    return logits[start:end]
