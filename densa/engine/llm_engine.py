"""The engine: one loop of schedule -> execute -> update, plus request bookkeeping around it.

Synchronous and single-threaded by design: the engine core (engine/core.py) runs it in its own
process or thread. It speaks tokens only: each step reports every request's new tokens as a
RequestDelta; text, stop strings and streaming are the front's (text/output.py).
"""

from __future__ import annotations

import itertools
import time

import torch

from densa.cache.integrity import IntegrityStats
from densa.cache.kv_manager import KVCacheManager
from densa.config import EngineConfig
from densa.engine.admission import check_request
from densa.engine.grammar_gate import GrammarAdmission
from densa.engine.hooks import StepHook, StepObservers, StepRecord
from densa.engine.kv_tier_setup import build_tiers, engine_fingerprint
from densa.engine.kv_tiers import KVTiers
from densa.engine.speculation import Speculation
from densa.engine.tracking import Tracked
from densa.ipc.messages import RequestDelta, TokenLogprobs
from densa.model.arch import ArchConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.events import ReleaseViolation
from densa.sched.output import KVExport, PackedPages, SchedulerOutput
from densa.sched.scheduler import Scheduler
from densa.setup.args import EngineArgs
from densa.setup.builder import build_engine_parts
from densa.spec.proposer import PromptState, Proposer
from densa.spec.speculator import Speculator
from densa.text.tokenizer import Tokenizer
from densa.utils.logging import get_logger
from densa.worker.model_runner import ModelRunner
from densa.worker.step_output import RunnerOutput

logger = get_logger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        runner: ModelRunner,
        arch: ArchConfig,
        kv_format: str = "",
        weight_format: str = "",
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.kv_format = kv_format  # described for people: logs, the handshake, /v1/models
        self.weight_format = weight_format
        self.tokenizer = tokenizer  # for whoever serves it (the handshake, the offline API)
        self.runner = runner
        self.arch = arch
        self.kv_manager = KVCacheManager(
            config.cache.num_pages, config.cache.page_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.integrity_stats = IntegrityStats()
        self._tracked: dict[str, Tracked] = {}
        self._finished_outputs: list[RequestDelta] = []
        self._ids = itertools.count()
        # The features beside the loop (engine/hooks.py), composed in _compose.
        self.grammar = GrammarAdmission(self.scheduler, runner.grammars, self._end_unscheduled)
        self.kv_tiers: KVTiers | None = None  # --kv-tier: pages below the device (attach_tiers)
        # Speculative decoding (docs/speculative.md): None unless configured with a proposer.
        spec = config.speculative
        deterministic = config.device.deterministic
        speculator = Speculator(proposer, spec, deterministic) if spec and proposer else None
        self._speculation: Speculation | None = None
        self.observers = StepObservers()  # measurement's hook: every step's StepRecord
        self.hooks: list[StepHook] = []
        self.speculator = speculator  # composes the hooks

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        """The engine densa/setup/ builds from these options, with its config's KV tiers."""
        parts = build_engine_parts(args)
        engine = cls(
            parts.config, parts.tokenizer, parts.runner, parts.arch,
            parts.kv_format, parts.weight_format, parts.proposer,
        )  # fmt: skip
        tiers = parts.config.tiers
        if tiers.specs:
            engine.attach_tiers(tiers.specs, tiers.cluster_secret_file, tiers.store_password_file)
        return engine

    def _compose(self) -> None:
        """The hooks, in the order every step calls them: grammar admission, the KV tiers,
        speculation (with the proposer state disaggregated prompts bring), then observers."""
        hooks: list[StepHook | None] = [self.grammar, self.kv_tiers, self._speculation]
        self.hooks = [hook for hook in hooks if hook is not None] + [self.observers]

    @property
    def speculator(self) -> Speculator | None:
        return None if self._speculation is None else self._speculation.speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self._speculation = None
        if speculator is not None:
            self._speculation = Speculation(speculator, self.scheduler, self.integrity_stats)
        self._compose()

    def attach_tiers(
        self,
        specs: tuple[str, ...] | list[str],
        secret_file: str | None,
        password_file: str | None = None,
    ) -> None:
        """Keep full prefix pages below the device too, in the tiers `specs` name (in order)."""
        from densa.model.key_centering import key_encoding

        model, template = self.config.model, self.runner.page_template()
        fingerprint = engine_fingerprint(model.model, self.weight_format, self.kv_format,
                                         template, self.arch,
                                         key_encoding(self.runner.model))  # fmt: skip
        tiers = build_tiers(specs, fingerprint, secret_file, password_file)
        self.detach_tiers()
        self.kv_tiers = KVTiers(tiers, self.kv_manager, self.scheduler, template)
        self._compose()

    def detach_tiers(self) -> None:
        """Stop using the tiers (queued writes finish first) and close them."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
            self.kv_tiers = None
            self.kv_manager.stop_recording_evictions()
            self._compose()

    # ---- requests ------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_scope: str = "",
        session_id: str | None = None,
        remote_prefill: bool = False,
        hold_pages: bool = False,
    ) -> str:
        """Queue a request. Raises ValueError (nothing changed) if it can never run.

        remote_prefill: its prompt's K/V will be copied in by a KV transfer (densa/disagg): it
        waits, unscheduled, until the transfer lands it (Scheduler.reserve_remote, then
        Scheduler.queue_landing; a step writes the pages). hold_pages: when it ends, its pages
        are held for a transfer to read until released (the prefill side of a handoff).

        Everything per-request that could fail is computed here, at admission, not inside a
        step where a failure would be harder to pin on this request: the prefix-cache block
        hashes of the prompt (the scope is hashed with them).
        """
        self.validate_request(prompt_token_ids, params)
        request = Request(
            request_id=request_id or self.new_request_id(),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            cache_scope=cache_scope,
            session_id=session_id,
            hold_pages=hold_pages,
        )
        if request.request_id in self._tracked:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        try:
            self.kv_manager.precompute(request)
        except Exception as exc:
            self.kv_manager.forget(request)
            raise ValueError(f"the request cannot be prepared: {exc}") from exc
        if remote_prefill:
            self.scheduler.add_remote(request)
        else:
            self.grammar.submit(request)
        self._tracked[request.request_id] = Tracked(request=request)
        return request.request_id

    def warm_up(self) -> None:
        """Run one short request through every stage (JIT-compiled kernels load, allocators grow)
        so the first real request is not the one that pays for it; leaves the engine as it was."""
        request_id = self.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=2))
        while request_id in self._tracked:
            self.step()
        self.kv_manager.reset_prefix_cache()
        self.kv_manager.reset_counters()
        self.scheduler.reset_counters()

    def _end_unscheduled(self, request: Request, status: RequestStatus, error: str | None) -> None:
        """End a request that never reached the scheduler (it holds no pages)."""
        request.status, request.error = status, error
        self._report_end(request.request_id)

    def abort_request(self, request_id: str) -> None:
        held = self.grammar.gate.drop(request_id)
        if held is not None:
            self._end_unscheduled(held, RequestStatus.FINISHED_ABORTED, None)
            return
        self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, error: str) -> None:
        """End one request with an error ("code: message"); its pages are freed (or held)."""
        self._finish(request_id, RequestStatus.FINISHED_ERROR, error)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._finished_outputs) or bool(self.grammar)

    def has_runnable_work(self) -> bool:
        """Would a step compute or report anything? (Requests waiting for a KV transfer to land
        would not: the loop then waits for messages instead of spinning.)"""
        return self.scheduler.has_schedulable or bool(self._finished_outputs) or bool(self.grammar)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished + len(self.grammar)

    def check_invariants(self) -> None:
        """Assert the page pool matches the requests' page tables (tests run this every step)."""
        owners = {rid: req.page_ids for rid, req in self.scheduler.requests.items()}
        owners.update({f"held:{rid}": pages for rid, (pages, _) in self.scheduler.held.items()})
        self.kv_manager.check_consistency(owners)
        if not self.scheduler.has_unfinished and not self.scheduler.held:
            assert self.kv_manager.num_free_pages == self.kv_manager.num_pages, (
                "idle but pages in use"
            )

    def fail_all(self, error: str) -> list[RequestDelta]:
        """End every request with an error; frees all pages. The last resort when the engine's own
        bookkeeping fails outside any request (faults inside one are confined to it, see step)."""
        for request_id in list(self.scheduler.requests):
            self._finish(request_id, RequestStatus.FINISHED_ERROR, error)
        for request in self.grammar.gate.drop_all():
            self._end_unscheduled(request, RequestStatus.FINISHED_ERROR, error)
        return self._take_finished()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run. Pure: safe to call from any thread."""
        check_request(
            prompt_token_ids, params, self.arch.vocab_size, self.config.scheduler.max_model_len,
            has_grammars=self.runner.grammars is not None,
        )  # fmt: skip

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one scheduled step; return outputs for every request that progressed or ended.

        Fault confinement: an exception while scheduling, running or post-processing one request
        ends that request alone with an error; everyone else continues with identical output
        (see worker/confinement.py for the forward pass, sched/scheduler.py for bookkeeping).
        Text (and a failure to make it) is the caller's, per request (text/output.py).
        """
        for hook in self.hooks:
            hook.before_schedule()
        outputs = self._take_finished()  # ended between steps, or before scheduling
        step = self.scheduler.schedule()
        for hook in self.hooks:
            step = hook.extend(step)
        record = self._execute(step)
        outputs += self._update(record)
        for hook in self.hooks:
            hook.after_step(record)
        return outputs + self._take_finished()

    def _execute(self, step: SchedulerOutput) -> StepRecord:
        self._take_scheduler_events()  # requests schedule() ended itself
        started = time.perf_counter()
        output = self.runner.execute(step)
        seconds = time.perf_counter() - started
        return StepRecord(step, output, seconds, len(self.scheduler.running))

    def _update(self, record: StepRecord) -> list[RequestDelta]:
        """Take in the runner's answer: end the requests that failed, append tokens (the
        scheduler), and report every request that progressed."""
        step, output = record.step, record.output
        for violation in output.refused_landings:
            self.integrity_stats.record(violation)  # its writer is among the errors
        for request_id, violation in output.failed.items():
            self.integrity_stats.record(violation)
            self._finish(request_id, RequestStatus.FINISHED_ERROR, violation.message)
        for request_id, error in output.errors.items():
            self._finish(request_id, RequestStatus.FINISHED_ERROR, error)
        updated = self.scheduler.update_from_output(
            step, output.sampled_token_ids, output.accepted_token_ids
        )
        logprobs = _token_logprobs(step, output)
        for request_id, prompt in output.prompt_logprobs.items():
            if request_id in self._tracked:
                self._tracked[request_id].take_prompt_logprobs(prompt.first_idx, prompt.entries)
        outputs = []
        for request in updated:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                tracked.absorb_tokens(logprobs.get(request.request_id, []))
                outputs.append(self._delta(tracked))
        self._take_scheduler_events()
        return outputs

    def queue_mtp_state(self, request_id: str, state: PromptState) -> None:
        """A decode worker's landing also brought the proposer's state of the prompt: it goes to
        the proposer after the step that lands the pages (and only if that landing succeeds)."""
        if self._speculation is not None:
            self._speculation.queue_prompt_state(request_id, state)

    # ---- device KV out of a step (held pages, scoring) ---------------------------------------
    def export_pages(self, owner_id: str, page_ids: list[int]) -> PackedPages:
        """Copy pages no step writes (a finished prompt's, held for a KV transfer) out of the
        device, as a step that computes nothing (Scheduler.side_step) carries them."""
        output = self.runner.execute(self.scheduler.side_step([KVExport(owner_id, page_ids)]))
        return output.exported[owner_id]

    def score(self, request: Request, token_ids: list[int], start_pos: int) -> torch.Tensor:
        """Teacher-forced logits [len(token_ids), vocab] fp32 of a request outside the queues
        whose pages the caller allocated (offline/scoring.py)."""
        return self.runner.score(self.scheduler.scoring_step(request, token_ids, start_pos))

    def end_scoring(self, request: Request) -> None:
        """The scored request's pages were freed: its tags and its end reach the runner."""
        self.runner.execute(self.scheduler.side_step(ended_ids=[request.request_id]))

    def flush_tiers(self) -> None:
        """Send down now the pages freed since the last step (as the next step would), and wait
        for the tiers' writer: a session's think-time, spent writing (benchmarks)."""
        tiers = self.kv_tiers
        if tiers is None:
            return
        step = tiers.extend(self.scheduler.side_step())
        output = self.runner.execute(step)
        tiers.after_step(StepRecord(step, output, 0.0, len(self.scheduler.running)))
        tiers.flush()

    # ---- reporting -----------------------------------------------------------------------------
    def _take_finished(self) -> list[RequestDelta]:
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def _take_scheduler_events(self) -> None:
        """Report the requests the scheduler ended itself; count pages it released badly."""
        for event in self.scheduler.drain_events():
            if isinstance(event, ReleaseViolation):
                self.integrity_stats.record(event.violation)
                continue
            self._report_end(event.request_id)

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        if self.scheduler.finish_request(request_id, status, error) is not None:
            self._report_end(request_id)

    def _report_end(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            self._finished_outputs.append(self._delta(tracked))

    def _delta(self, tracked: Tracked) -> RequestDelta:
        delta = tracked.delta()
        if delta.finished:
            del self._tracked[delta.request_id]
            for hook in self.hooks:
                hook.request_ended(delta.request_id)
        return delta


def _token_logprobs(step: SchedulerOutput, output: RunnerOutput) -> dict[str, list[TokenLogprobs]]:
    """Each request's logprobs of the tokens the step brought, accepted proposals first. A
    landed request's first token was sampled where its prompt was computed."""
    logprobs = {
        landing.request_id: [landing.first_logprobs]
        for landing in step.kv_landings
        if landing.first_logprobs is not None
    }
    for request_id, sampled in output.logprobs.items():
        logprobs[request_id] = [*output.accepted_logprobs.get(request_id, []), sampled]
    return logprobs
