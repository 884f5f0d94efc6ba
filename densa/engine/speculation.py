"""Speculative decoding's part in every step (docs/speculative.md), as an engine hook.

Before the scheduler builds a step the speculator proposes tokens for the decoding requests (it
sets their `spec_token_ids`, which the scheduler puts in their chunks for the target to verify);
after it, it counts what was accepted, hands the proposer the target's hidden states where it
reads them, and drops the state of requests that stopped running.

Disaggregation's part is here too: a decode worker's landing may bring the proposer's state of
the prompt (an MTP layer's rows, `Proposer.prompt_states`); it goes to the proposer after the
step that lands the pages, and only if that landing succeeded.
"""

from __future__ import annotations

from densa.cache.integrity import IntegrityStats
from densa.engine.hooks import StepHook, StepRecord
from densa.sched.output import KVLanding
from densa.sched.scheduler import Scheduler
from densa.spec.proposer import PromptState
from densa.spec.speculator import Speculator


class Speculation(StepHook):
    def __init__(
        self, speculator: Speculator, scheduler: Scheduler, integrity_stats: IntegrityStats
    ) -> None:
        self.speculator = speculator
        self.scheduler = scheduler
        self.integrity_stats = integrity_stats
        # Prompt states that came with queued landings (a decode worker): request id -> state.
        self._prompt_states: dict[str, PromptState] = {}

    def before_schedule(self) -> None:
        """The proposals the step about to be scheduled verifies. Asked here, before it, rather
        than after the last one: the last step's tokens (a prompt's first among them) are
        streamed before a draft model catches up on a prompt."""
        scheduler = self.scheduler
        running, config = scheduler.running, scheduler.config
        prompt_queued = bool(scheduler.waiting) and len(running) < config.max_num_seqs
        self.speculator.propose(running, config.max_model_len, prompt_queued)

    def after_step(self, record: StepRecord) -> None:
        """Count what the step verified and drop the state of requests that stopped running."""
        step, output = record.step, record.output
        speculator = self.speculator
        speculator.observe(step, output.accepted_token_ids)
        speculator.observe_hidden(step, output.accepted_token_ids, output.hidden)
        running = self.scheduler.running
        self._land_prompt_states(step.kv_landings, {r.request_id for r in running})
        # A prefill worker's finished prompt keeps its proposer state while its pages are held
        # for a transfer: its MTP layer's rows travel with them (docs/speculative.md).
        speculator.keep_only([*(r.request_id for r in running), *self.scheduler.held])
        for violation in speculator.take_violations():
            self.integrity_stats.record(violation)

    def queue_prompt_state(self, request_id: str, state: PromptState) -> None:
        """A landing queued for the next step also brought the proposer's state of the prompt."""
        self._prompt_states[request_id] = state

    def _land_prompt_states(self, landings: list[KVLanding], running_ids: set[str]) -> None:
        if not self._prompt_states:
            return
        prompt_states = self.speculator.proposer.prompt_states
        for landing in landings:
            request_id = landing.request_id
            state = self._prompt_states.pop(request_id, None)
            if state is None or request_id not in running_ids or prompt_states is None:
                continue  # no state came, or the landing failed
            if prompt_states.land_prompt(request_id, state):
                self.speculator.adopt(request_id)
        for request_id in [r for r in self._prompt_states if r not in self.scheduler.requests]:
            del self._prompt_states[request_id]  # it ended before its landing
