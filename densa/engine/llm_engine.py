"""The engine: one loop of schedule -> execute -> update, plus request bookkeeping around it.

Synchronous and single-threaded by design: the engine core (engine/core.py) runs it in its own
process or thread. It speaks tokens only: each step reports every request's new tokens as a
RequestDelta; text, stop strings and streaming are the front's (text/output.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from densa.cache.integrity import IntegrityStats
from densa.cache.kv_manager import KVCacheManager
from densa.config import EngineConfig
from densa.engine.admission import check_request
from densa.engine.confinement import execute_confined
from densa.engine.grammar_gate import GrammarGate
from densa.engine.kv_tier_setup import build_tiers, engine_fingerprint
from densa.engine.kv_tiers import KVTiers
from densa.ipc.messages import RequestDelta, TokenLogprobs
from densa.model.arch import ArchConfig
from densa.request import Request, RequestStatus
from densa.sampling_params import SamplingParams
from densa.sched.events import ReleaseViolation
from densa.sched.output import SchedulerOutput
from densa.sched.scheduler import Scheduler
from densa.setup.args import EngineArgs
from densa.setup.builder import build_engine_parts
from densa.spec.mtp import MTPProposer, PromptState
from densa.spec.proposer import Proposer
from densa.spec.speculator import Speculator
from densa.text.tokenizer import Tokenizer
from densa.utils.logging import get_logger
from densa.worker.model_runner import ModelRunner

logger = get_logger(__name__)


@dataclass
class _Tracked:
    """Engine-side state of one request: its scheduler record plus what is not yet reported."""

    request: Request
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_absorbed: int = 0  # output tokens already queued for the client
    # Logprobs of prompt tokens 1, 2, ... computed so far (SamplingParams.prompt_logprobs), sent
    # whole with the first delta; a recompute after a preemption brings some again.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    def take_prompt_logprobs(self, first_idx: int, entries: list[TokenLogprobs]) -> None:
        """Keep the entries for prompt tokens first_idx, ... not already kept."""
        num_known = len(self.prompt_logprobs) - (first_idx - 1)  # entries[:num_known] are known
        if num_known >= 0:
            self.prompt_logprobs.extend(entries[num_known:])


@dataclass(frozen=True)
class StepRecord:
    """What one step ran, for observers (benchmarks, profilers): read-only."""

    step: SchedulerOutput
    seconds: float  # the runner's share: batch building, forward pass, sampling
    num_running: int  # requests holding pages after scheduling


StepObserver = Callable[[StepRecord], None]


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
        self._tracked: dict[str, _Tracked] = {}
        self.grammar_gate = GrammarGate()  # structured requests whose grammar is compiling
        self._finished_outputs: list[RequestDelta] = []
        self._ids = itertools.count()
        # Called after every runner step (see StepRecord); nothing runs when the list is empty.
        self.step_observers: list[StepObserver] = []
        self.kv_tiers: KVTiers | None = None  # --kv-tier: pages below the device (attach_tiers)
        # Speculative decoding (docs/speculative.md): None unless configured with a proposer.
        spec = config.speculative
        deterministic = config.device.deterministic
        self.speculator = Speculator(proposer, spec, deterministic) if spec and proposer else None
        # MTP states that came with queued landings (a decode worker): request id -> state.
        self._mtp_states: dict[str, PromptState] = {}

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

    def attach_tiers(
        self,
        specs: tuple[str, ...] | list[str],
        secret_file: str | None,
        password_file: str | None = None,
    ) -> None:
        """Keep full prefix pages below the device too, in the tiers `specs` name (in order)."""
        from densa.model.key_centering import key_encoding
        from densa.worker.kv_io import pack

        model = self.config.model
        fingerprint = engine_fingerprint(model.model, self.weight_format, self.kv_format,
                                         pack(self.runner.kv_caches, []), self.arch,
                                         key_encoding(self.runner.model))  # fmt: skip
        tiers = build_tiers(specs, fingerprint, secret_file, password_file)
        self.detach_tiers()
        self.kv_tiers = KVTiers(tiers, self.kv_manager, self.runner, self.scheduler.fetching)

    def detach_tiers(self) -> None:
        """Stop using the tiers (queued writes finish first) and close them."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
            self.kv_tiers = None
            self.kv_manager.stop_recording_evictions()

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
            self._submit(request)
        self._tracked[request.request_id] = _Tracked(request=request)
        return request.request_id

    def warm_up(self) -> None:
        """Run one short request through every stage (JIT-compiled kernels load, allocators grow)
        so the first real request is not the one that pays for it; leaves the engine as it was."""
        request_id = self.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=2))
        while request_id in self._tracked:
            self.step()
        self.kv_manager.reset_prefix_cache()
        self.kv_manager.num_queried_tokens = self.kv_manager.num_hit_tokens = 0
        self.scheduler.num_generated_tokens = self.scheduler.num_preemptions = 0

    def _submit(self, request: Request) -> None:
        """Schedule the request now, or once its grammar is compiled (off this thread)."""
        spec = request.sampling_params.structured
        grammars = self.runner.grammars
        if spec is None or grammars is None:
            self.scheduler.add_request(request)
            return
        grammar = grammars.submit(spec)
        if grammar.done() and grammar.exception() is None:  # a cache hit: no wait
            self.scheduler.add_request(request)
        else:
            self.grammar_gate.hold(request, grammar)

    def _admit_compiled(self) -> None:
        released = self.grammar_gate.release()
        for request in released.ready:
            self.scheduler.add_request(request)
        for request, error in released.failed:
            self._end_unscheduled(request, RequestStatus.FINISHED_ERROR, error)

    def _end_unscheduled(self, request: Request, status: RequestStatus, error: str | None) -> None:
        """End a request that never reached the scheduler (it holds no pages)."""
        request.status, request.error = status, error
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            self._finished_outputs.append(self._output(tracked))

    def abort_request(self, request_id: str) -> None:
        held = self.grammar_gate.drop(request_id)
        if held is not None:
            self._end_unscheduled(held, RequestStatus.FINISHED_ABORTED, None)
            return
        self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def fail_request(self, request_id: str, error: str) -> None:
        """End one request with an error ("code: message"); its pages are freed (or held)."""
        self._finish(request_id, RequestStatus.FINISHED_ERROR, error)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished or bool(self._finished_outputs) or bool(self.grammar_gate)
        )

    def has_runnable_work(self) -> bool:
        """Would a step compute or report anything? (Requests waiting for a KV transfer to land
        would not: the loop then waits for messages instead of spinning.)"""
        return (
            self.scheduler.has_schedulable
            or bool(self._finished_outputs)
            or bool(self.grammar_gate)
        )

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished + len(self.grammar_gate)

    def check_invariants(self) -> None:
        """Assert the page pool matches the requests' page tables (tests run this every step)."""
        owners = {rid: req.page_ids for rid, req in self.scheduler.requests.items()}
        owners.update({f"held:{rid}": pages for rid, (pages, _) in self.scheduler.held.items()})
        self.kv_manager.pool.check_consistency(owners)
        if not self.scheduler.has_unfinished and not self.scheduler.held:
            assert self.kv_manager.num_free_pages == self.kv_manager.num_pages, (
                "idle but pages in use"
            )

    def fail_all(self, error: str) -> list[RequestDelta]:
        """End every request with an error; frees all pages. The last resort when the engine's own
        bookkeeping fails outside any request (faults inside one are confined to it, see step)."""
        for request_id in list(self.scheduler.requests):
            self._finish(request_id, RequestStatus.FINISHED_ERROR, error)
        for request in self.grammar_gate.drop_all():
            self._end_unscheduled(request, RequestStatus.FINISHED_ERROR, error)
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

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
        (see engine/confinement.py for the forward pass, sched/scheduler.py for bookkeeping).
        Text (and a failure to make it) is the caller's, per request (text/output.py).
        """
        outputs, self._finished_outputs = self._finished_outputs, []
        self._admit_compiled()
        if not self.scheduler.has_unfinished and self.grammar_gate:
            self.grammar_gate.wait(timeout=0.01)  # only compiles pending: do not spin
            self._admit_compiled()
        outputs.extend(self._finished_outputs)
        self._finished_outputs = []
        tiers = self.kv_tiers
        if tiers is not None:
            tiers.write_back()  # evicted between steps (a KV transfer's reservation)
            num_slots = self.config.scheduler.max_num_seqs - len(self.scheduler.running)
            tiers.fetch_for(self.scheduler.waiting, num_slots, bool(self.scheduler.running))
        self._propose()
        sched_out = self.scheduler.schedule()
        if tiers is not None:
            tiers.write_back()  # what schedule() evicted, before the step writes those pages
        self._take_scheduler_events()
        started = time.perf_counter()
        runner_out = execute_confined(self.runner, sched_out)
        if self.step_observers:
            record = StepRecord(
                sched_out, time.perf_counter() - started, len(self.scheduler.running)
            )
            for observer in self.step_observers:
                observer(record)
        for violation in self.runner.take_refused_landings():
            self.integrity_stats.record(violation)  # its request is among the errors
        for request_id, violation in runner_out.failed.items():
            self.integrity_stats.record(violation)
            self._finish(request_id, RequestStatus.FINISHED_ERROR, violation.message)
        for request_id, error in runner_out.errors.items():
            self._finish(request_id, RequestStatus.FINISHED_ERROR, error)
        updated = self.scheduler.update_from_output(
            sched_out, runner_out.sampled_token_ids, runner_out.accepted_token_ids
        )
        # A landed request's first token was sampled where its prompt was computed.
        logprobs: dict[str, list[TokenLogprobs]] = {
            landing.request_id: [landing.first_logprobs]
            for landing in sched_out.kv_landings
            if landing.first_logprobs is not None
        }
        for request_id, prompt in runner_out.prompt_logprobs.items():
            if request_id in self._tracked:
                self._tracked[request_id].take_prompt_logprobs(prompt.first_idx, prompt.entries)
        for request_id, sampled in runner_out.logprobs.items():
            logprobs[request_id] = [*runner_out.accepted_logprobs.get(request_id, []), sampled]
        for request in updated:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                self._absorb_tokens(tracked, logprobs.get(request.request_id, []))
                outputs.append(self._output(tracked))
        self._take_scheduler_events()
        outputs.extend(self._finished_outputs)
        self._finished_outputs = []
        self._speculate(sched_out, runner_out.accepted_token_ids, runner_out.hidden)
        return outputs

    def _propose(self) -> None:
        """The proposals the step about to be scheduled verifies. Asked here, before it, rather
        than after the last one: the last step's tokens (a prompt's first among them) are
        streamed before a draft model catches up on a prompt."""
        if self.speculator is None:
            return
        running, config = self.scheduler.running, self.config.scheduler
        prompt_queued = bool(self.scheduler.waiting) and len(running) < config.max_num_seqs
        self.speculator.propose(running, config.max_model_len, prompt_queued)

    def _speculate(
        self,
        step: SchedulerOutput,
        accepted: dict[str, list[int]],
        hidden: dict[str, torch.Tensor],
    ) -> None:
        """Count what the step verified and drop the state of requests that stopped running."""
        if self.speculator is None:
            return
        self.speculator.observe(step, accepted)
        self.speculator.observe_hidden(step, accepted, hidden)
        running = self.scheduler.running
        self._land_mtp_states(step, {r.request_id for r in running})
        # A prefill worker's finished prompt keeps its proposer state while its pages are held
        # for a transfer: its MTP layer's rows travel with them (docs/speculative.md).
        self.speculator.keep_only([*(r.request_id for r in running), *self.scheduler.held])
        for violation in self.speculator.take_violations():
            self.integrity_stats.record(violation)

    def queue_mtp_state(self, request_id: str, state: PromptState) -> None:
        """A decode worker's landing also brought the MTP layer's state of the prompt: it goes to
        the proposer after the step that lands the pages (and only if that landing succeeds)."""
        self._mtp_states[request_id] = state

    def _land_mtp_states(self, step: SchedulerOutput, running_ids: set[str]) -> None:
        """Hand the MTP proposer the states of the prompts this step landed (running now)."""
        assert self.speculator is not None
        proposer = self.speculator.proposer
        for landing in step.kv_landings:
            request_id = landing.request_id
            state = self._mtp_states.pop(request_id, None)
            if state is None or request_id not in running_ids:
                continue  # no state came, or the landing failed
            if isinstance(proposer, MTPProposer) and proposer.land_prompt(request_id, state):
                self.speculator.adopt(request_id)
        for request_id in [r for r in self._mtp_states if r not in self._tracked]:
            del self._mtp_states[request_id]  # it ended before its landing

    def _take_scheduler_events(self) -> None:
        """Report the requests the scheduler ended itself; count pages it released badly."""
        for event in self.scheduler.drain_events():
            if isinstance(event, ReleaseViolation):
                self.integrity_stats.record(event.violation)
                continue
            tracked = self._tracked.get(event.request_id)
            if tracked is not None:
                self._finished_outputs.append(self._output(tracked))

    def _absorb_tokens(self, tracked: _Tracked, logprobs: list[TokenLogprobs]) -> None:
        """Queue the request's tokens since the last report (one, or several when it accepted
        proposals; a stop may have cut those short, and their logprobs with them)."""
        new_token_ids = tracked.request.output_token_ids[tracked.num_absorbed :]
        tracked.num_absorbed += len(new_token_ids)
        tracked.pending_token_ids.extend(new_token_ids)
        tracked.pending_logprobs.extend(logprobs[: len(new_token_ids)])

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        request = self.scheduler.finish_request(request_id, status, error)
        tracked = self._tracked.get(request_id)
        if request is None or tracked is None:
            return
        self._finished_outputs.append(self._output(tracked))

    def _output(self, tracked: _Tracked) -> RequestDelta:
        request = tracked.request
        finished = request.is_finished
        output = RequestDelta(
            request_id=request.request_id,
            new_token_ids=tracked.pending_token_ids,
            new_logprobs=tracked.pending_logprobs,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            error=request.error,
            error_code=_error_code(request.error),
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
        )
        if request.sampling_params.prompt_logprobs is not None and not tracked.prompt_logprobs_sent:
            output.prompt_logprobs, tracked.prompt_logprobs = tracked.prompt_logprobs, []
            tracked.prompt_logprobs_sent = True
        tracked.pending_token_ids, tracked.pending_logprobs = [], []
        if finished:
            del self._tracked[request.request_id]
            if self.kv_tiers is not None:
                self.kv_tiers.forget(request.request_id)
        return output


def _error_code(error: str | None) -> str | None:
    if error is None:
        return None
    return error.split(":", 1)[0] if ":" in error else "engine_error"
