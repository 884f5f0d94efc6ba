"""Runs one scheduled step: build the flattened batch, run the model over paged KV, sample.

Input:  a SchedulerOutput (plain data).  Output: a RunnerOutput (plain data).
The runner owns the KV tensors and the sampler's per-request RNG state, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from densa.model.attention import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    LayerKVCache,
    build_group,
)
from densa.sched.output import ScheduledRequest, SchedulerOutput
from densa.worker.sampler import Sampler, SampleRequest, TokenLogprobs


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests the runner refused to compute (e.g. a KV integrity violation), with the reason.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    order: list[ScheduledRequest]  # requests in row order (decodes first)
    sample_rows: torch.Tensor  # [N] row of the last token of each sampling request
    samplers: list[ScheduledRequest]  # the N sampling requests, in sample_rows order


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[LayerKVCache],
        page_size: int,
        backend: AttentionBackend,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> RunnerOutput:
        for request_id in step.finished_request_ids:
            self.sampler.forget(request_id)
        if step.is_empty:
            return RunnerOutput()
        inputs = self.prepare_inputs(step.scheduled)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend
        )
        if not inputs.samplers:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[inputs.sample_rows])  # type: ignore[operator]
        return self._sample(logits, inputs.samplers)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
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
                sample_rows.append(len(token_ids) - 1)
        positions_t = torch.tensor(positions, dtype=torch.long)
        meta = AttentionMetadata(
            slot_pages=torch.tensor(slot_pages, dtype=torch.long, device=self.device),
            slot_offsets=(positions_t % self.page_size).to(self.device),
            decode=self._group(0, decodes),
            prefill=self._group(len(decodes), prefills),
        )
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=positions_t.to(self.device),
            meta=meta,
            order=order,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            samplers=[item for item in order if item.sample],
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

    def _sample(self, logits: torch.Tensor, samplers: list[ScheduledRequest]) -> RunnerOutput:
        rows = [
            SampleRequest(
                s.request_id,
                s.sampling_params,
                s.prompt_token_ids,
                s.output_token_ids,
                self.eos_token_ids,
            )
            for s in samplers
        ]
        result = self.sampler.sample(logits.cpu(), rows)
        output = RunnerOutput()
        for item, token_id, logprobs in zip(
            samplers, result.token_ids, result.logprobs, strict=True
        ):
            output.sampled_token_ids[item.request_id] = token_id
            if logprobs is not None:
                output.logprobs[item.request_id] = logprobs
        return output
