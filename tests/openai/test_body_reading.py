"""Reading request bodies: huge bodies are read one at a time, so a flood of them leaves the event
loop to everyone else; small bodies never wait; lone surrogates are found in any string."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from densa.openai.prepare import LARGE_BODY_BYTES, LargeBodyGate, first_unencodable_field, read_json


class FakeRequest:
    """What read_json uses of a Starlette request: headers and the body stream."""

    def __init__(self, body: bytes, log: list[str], name: str, chunk_delay: float = 0.0) -> None:
        self.headers = {"content-length": str(len(body))}
        self._body, self._log, self._name, self._delay = body, log, name, chunk_delay

    async def stream(self) -> AsyncIterator[bytes]:
        self._log.append(f"{self._name} starts")
        for start in range(0, len(self._body), 256 * 1024):
            await asyncio.sleep(self._delay)
            yield self._body[start : start + 256 * 1024]
        self._log.append(f"{self._name} ends")


def _body(num_bytes: int) -> bytes:
    return json.dumps({"prompt": "x" * num_bytes}).encode()


def test_large_bodies_are_read_one_at_a_time_and_small_ones_never_wait() -> None:
    async def scenario() -> list[str]:
        log: list[str] = []
        gate = LargeBodyGate()
        big = [FakeRequest(_body(2 * LARGE_BODY_BYTES), log, f"big{i}", 0.01) for i in range(2)]
        small = FakeRequest(_body(100), log, "small")
        tasks = [asyncio.create_task(read_json(r, 8 * LARGE_BODY_BYTES, 10, gate)) for r in big]
        await asyncio.sleep(0.02)  # big0 is being read; big1 waits for the gate
        await read_json(small, 8 * LARGE_BODY_BYTES, 10, gate)  # type: ignore[arg-type]
        await asyncio.gather(*tasks)
        return log

    log = asyncio.run(scenario())
    assert log.index("big0 ends") < log.index("big1 starts")  # never two huge bodies at once
    assert log.index("small ends") < log.index("big0 ends")  # the small one did not queue


def test_after_a_large_body_the_next_waits_for_its_cpu_share_and_small_ones_do_not() -> None:
    """duty 0.2: a large body that took 0.1 s of CPU holds the next one back 0.4 s."""
    cpu = iter([0.0, 0.1, 0.1, 0.1])  # big0 costs 0.1 s of CPU; big1 costs nothing

    async def scenario() -> dict[str, float]:
        log: list[str] = []
        times: dict[str, float] = {}
        gate = LargeBodyGate(duty=0.2, max_pause_s=1.0, cpu_clock=lambda: next(cpu))
        big = [FakeRequest(_body(2 * LARGE_BODY_BYTES), log, f"big{i}") for i in range(2)]

        async def read(name: str, request: FakeRequest) -> None:
            await read_json(request, 8 * LARGE_BODY_BYTES, 10, gate)  # type: ignore[arg-type]
            times[name] = time.monotonic()

        await read("big0", big[0])
        waiting = asyncio.create_task(read("big1", big[1]))
        await read("small", FakeRequest(_body(100), log, "small"))
        await waiting
        return times

    times = asyncio.run(scenario())
    assert times["big1"] - times["big0"] >= 0.38  # the pause: 0.1 x (1 / 0.2 - 1)
    assert times["small"] - times["big0"] < 0.3  # a small body never waits for the gate


def test_a_large_body_pause_is_capped() -> None:
    gate = LargeBodyGate(duty=0.01, max_pause_s=0.3, cpu_clock=iter([0.0, 5.0, 5.0, 5.0]).__next__)

    async def scenario() -> float:
        async with gate.admit():
            pass
        started = time.monotonic()
        async with gate.admit():
            return time.monotonic() - started

    assert 0.25 <= asyncio.run(scenario()) < 2.0  # uncapped it would be 5 x 99 = 495 s


def test_surrogates_are_found_in_non_ascii_text_and_ascii_text_is_skipped_fast() -> None:
    assert first_unencodable_field({"messages": [{"content": "plain " * 1000}]}) is None
    assert first_unencodable_field({"messages": [{"content": "é\ud800"}]}) == "messages[0].content"
    assert first_unencodable_field({"user": "ok", "k\udfff": 1}) == "k\udfff"
