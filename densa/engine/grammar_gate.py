"""Requests whose grammar is still compiling wait here, outside the scheduler.

A request with a structured output is scheduled only once its grammar is ready, so a slow
compile delays that request alone: the engine keeps stepping everyone else meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from densa.engine.hooks import StepHook
from densa.request import Request, RequestStatus
from densa.sched.scheduler import Scheduler
from densa.worker.grammar import CompiledGrammar, GrammarCompiler


@dataclass(frozen=True)
class Released:
    ready: list[Request]  # grammar compiled: schedule these, in arrival order
    failed: list[tuple[Request, str]]  # grammar refused: end these with the message


class GrammarGate:
    def __init__(self) -> None:
        self._held: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}  # arrival order

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, request: Request, grammar: Future[CompiledGrammar]) -> None:
        self._held[request.request_id] = (request, grammar)

    def drop(self, request_id: str) -> Request | None:
        held = self._held.pop(request_id, None)
        return held[0] if held is not None else None

    def drop_all(self) -> list[Request]:
        requests = [request for request, _ in self._held.values()]
        self._held.clear()
        return requests

    def release(self) -> Released:
        """Take every request whose compile has finished, well or badly."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, (request, grammar) in list(self._held.items()):
            if not grammar.done():
                continue
            del self._held[request_id]
            error = grammar.exception()
            if error is None:
                ready.append(request)
            else:
                failed.append((request, f"invalid_grammar: {error}"))
        return Released(ready, failed)

    def wait(self, timeout: float) -> None:
        """Sleep until some held grammar is ready (the engine has nothing else to run)."""
        if self._held:
            wait([grammar for _, grammar in self._held.values()], timeout, FIRST_COMPLETED)


class GrammarAdmission(StepHook):
    """Structured requests reach the scheduler through here (an engine hook): at once when
    their grammar is compiled (a cache hit), else once it is, checked before every step; a
    grammar that fails ends its request (`end`) without it ever being scheduled."""

    def __init__(
        self,
        scheduler: Scheduler,
        grammars: GrammarCompiler | None,
        end: Callable[[Request, RequestStatus, str | None], None],
    ) -> None:
        self.scheduler = scheduler
        self.grammars = grammars  # None: unconstrained requests only
        self.gate = GrammarGate()
        self._end = end

    def __len__(self) -> int:
        return len(self.gate)

    def submit(self, request: Request) -> None:
        """Schedule the request now, or once its grammar is compiled (off this thread)."""
        spec = request.sampling_params.structured
        if spec is None or self.grammars is None:
            self.scheduler.add_request(request)
            return
        grammar = self.grammars.submit(spec)
        if grammar.done() and grammar.exception() is None:  # a cache hit: no wait
            self.scheduler.add_request(request)
        else:
            self.gate.hold(request, grammar)

    def before_schedule(self) -> None:
        self._admit_compiled()
        if not self.scheduler.has_unfinished and self.gate:
            self.gate.wait(timeout=0.01)  # only compiles pending: do not spin
            self._admit_compiled()

    def _admit_compiled(self) -> None:
        released = self.gate.release()
        for request in released.ready:
            self.scheduler.add_request(request)
        for request, error in released.failed:
            self._end(request, RequestStatus.FINISHED_ERROR, error)
