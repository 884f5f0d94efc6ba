"""The features beside the engine loop, behind one interface (docs/architecture.md draws it).

`LLMEngine.step` is schedule -> execute -> update; everything else that happens in a step is a
hook, composed when the engine is built (LLMEngine._compose), each called in that order:

    before_schedule()   grammar: admit requests whose grammar compiled; KV tiers: take in
                        ended lookups, start new ones; speculation: propose tokens
    extend(step)        KV tiers: add the pages to copy out and the blocks to land
    after_step(record)  KV tiers: index landed blocks, queue exported pages for the tiers;
                        speculation: count what was accepted, hand the proposer the hidden
                        states, land the proposer state a prefill worker sent; observers
    request_ended(id)   drop what the hook keeps for a request that ended

A hook reads the scheduler and changes its state only through its methods (never its
collections), and reaches device KV only through the step: what it adds in `extend`, and what
the runner answered in `record.output`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from densa.sched.output import SchedulerOutput
from densa.worker.step_output import RunnerOutput


@dataclass(frozen=True)
class StepRecord:
    """What one step ran and answered: read-only, for hooks and observers."""

    step: SchedulerOutput
    output: RunnerOutput
    seconds: float  # the runner's share: batch building, forward pass, sampling
    num_running: int  # requests holding pages after scheduling


class StepHook(Protocol):
    """One feature's part in every step; each method does nothing unless the hook says so."""

    def before_schedule(self) -> None:
        """Before the scheduler builds the step (it may change requests the step will see)."""
        return None

    def extend(self, step: SchedulerOutput) -> SchedulerOutput:
        """The step as the runner will get it: `step`, or a copy with what this hook adds."""
        return step

    def after_step(self, record: StepRecord) -> None:
        """After the engine took in the runner's answer (tokens appended, requests ended)."""
        return None

    def request_ended(self, request_id: str) -> None:
        """The request ended (finished, aborted, failed): drop what is kept for it."""
        return None


StepObserver = Callable[[StepRecord], None]


class StepObservers(StepHook):
    """Measurement's hook (benchmarks, profilers): every step's record, to each observer."""

    def __init__(self) -> None:
        self._observers: list[StepObserver] = []

    def add(self, observer: StepObserver) -> None:
        self._observers.append(observer)

    def clear(self) -> None:
        self._observers.clear()

    def after_step(self, record: StepRecord) -> None:
        for observer in self._observers:
            observer(record)

    def remove(self, observer: StepObserver) -> None:
        self._observers.remove(observer)
