"""A KVTransport that misbehaves on purpose: the fault-injection fake every transport test uses.

Faults apply to sent messages, chosen by message type, each a given number of times:

    drop       the message never arrives
    delay      it arrives `delay_s` later (released by the next send/receive after that time)
    duplicate  it arrives twice
    reorder    it is held back and arrives right after the next message sent
    truncate   its last frame loses its second half
    corrupt    one byte of its last frame is flipped
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from densa.disagg import messages
from densa.disagg.transport import Frames, KVTransport, Received

FAULT_KINDS = ("drop", "delay", "duplicate", "reorder", "truncate", "corrupt")


@dataclass
class Fault:
    kind: str
    message: str  # the message type it applies to, e.g. "KVPages", "KVAck"
    times: int = 1  # how many such messages it hits (then it is spent)
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")


class FaultyTransport:
    def __init__(
        self, inner: KVTransport, faults: list[Fault], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.inner = inner
        self.faults = faults
        self.clock = clock
        self.injected: list[tuple[str, str]] = []  # (kind, message type), in order
        self._delayed: list[tuple[float, str, list[bytes]]] = []
        self._held_back: tuple[str, list[bytes]] | None = None

    def listen(self, address: str | None = None) -> str:
        return self.inner.listen(address)

    def connect(self, address: str) -> str:
        return self.inner.connect(address)

    def disconnect(self, peer: str) -> None:
        self.inner.disconnect(peer)

    def send(self, peer: str, frames: Frames) -> None:
        self._release_delayed()
        copied = [bytes(frame) for frame in frames]
        fault = self._take(copied)
        held, self._held_back = self._held_back, None
        if fault is None:
            self.inner.send(peer, copied)
        elif fault.kind == "delay":
            self._delayed.append((self.clock() + fault.delay_s, peer, copied))
        elif fault.kind == "duplicate":
            self.inner.send(peer, copied)
            self.inner.send(peer, copied)
        elif fault.kind == "reorder":
            self._held_back = (peer, copied)
        elif fault.kind in ("truncate", "corrupt"):
            self.inner.send(peer, _damaged(copied, fault.kind))
        if held is not None:  # the message held back arrives after this one
            self.inner.send(*held)

    def receive(self) -> Received:
        self._release_delayed()
        return self.inner.receive()

    def waitables(self) -> list[Any]:
        return self.inner.waitables()

    def close(self) -> None:
        self.inner.close()

    def _take(self, frames: list[bytes]) -> Fault | None:
        message = messages.decode_or_none(frames)
        if message is None:
            return None
        kind = type(message).__name__
        for fault in self.faults:
            if fault.times > 0 and fault.message == kind:
                fault.times -= 1
                self.injected.append((fault.kind, kind))
                return fault
        return None

    def _release_delayed(self) -> None:
        now = self.clock()
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, peer, frames in due:
            self.inner.send(peer, frames)


def _damaged(frames: list[bytes], kind: str) -> list[bytes]:
    last = bytearray(frames[-1])
    if kind == "truncate":
        last = last[: len(last) // 2]
    elif last:
        last[len(last) // 2] ^= 0xFF
    return [*frames[:-1], bytes(last)]
