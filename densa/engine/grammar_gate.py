"""Requests whose grammar is still compiling wait here, outside the scheduler.

A request with a structured output is scheduled only once its grammar is ready, so a slow
compile delays that request alone: the engine keeps stepping everyone else meanwhile.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from densa.request import Request
from densa.worker.grammar import CompiledGrammar


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
