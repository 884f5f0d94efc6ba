"""What the KV agents need from their engine: small protocols, implemented over an LLMEngine by
engine/disagg_port.py (and by nothing else), plus the plain data they exchange with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from densa.disagg import messages as m
from densa.disagg.wire import Packed
from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams


@dataclass(frozen=True)
class Reservation:
    """Pages the engine allocated for a request's prompt, minus the prefix it already caches."""

    first_block: int
    dest_page_ids: list[int]
    dest_tags: list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: str
    with_mtp: bool = False  # the engine proposes with an MTP layer: ask for its prompt state


@dataclass(frozen=True)
class Landing:
    dest_page_ids: list[int]
    dest_tags: list[int]
    layout: m.WireLayout
    frames: list[memoryview]  # the target's pages only
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    num_cached_tokens: int
    mtp: m.MTPState | None = None  # checked (landing_checks.check_mtp_state)
    mtp_frames: list[memoryview] | None = None  # its pages' frames, then the hidden state


class DecodeEngine(Protocol):
    """What the decode agent needs from its engine (engine/disagg_port.py implements it)."""

    def is_receiving(self, request_id: str) -> bool:
        """Is the request alive and still waiting for its prompt's K/V?"""
        ...

    def reserve_remote(self, request_id: str) -> Reservation | None:
        """Allocate and tag destination pages (the request then holds them); None: no room yet."""
        ...

    def land_remote(self, request_id: str, landing: Landing) -> str | None:
        """Queue the pages for the engine's next step (the runner checks the tags again and
        writes them before any read; the request then runs from its first token). Returns why
        it was refused now (the engine then ended the request), or None."""
        ...

    def fail_remote(self, request_id: str, error: str) -> None:
        """End the request with this error (its destination pages stay held)."""
        ...

    def release_held(self, request_id: str) -> None: ...


class PrefillEngine(Protocol):
    """The prefill worker's engine, as its agent (prefill_side.py) drives it."""

    def start_prefill(self, request_id: str, request: m.PrefillRequest) -> str | None:
        """Queue the prompt (max_tokens=1, pages held at the end); why not, or None."""
        ...

    def held_page_ids(self, request_id: str) -> list[int] | None:
        """The finished request's held pages in block order (None: it holds none)."""
        ...

    def pack(self, request_id: str, page_ids: list[int], request: m.PrefillRequest) -> Packed:
        """The held pages (and, when the request asks with_mtp and this engine runs an MTP
        layer, that layer's state of the prompt: messages.MTPState)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def release_held(self, request_id: str) -> None: ...
