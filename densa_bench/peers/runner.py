"""`densa bench peers`: densa's server vs llama.cpp's llama-server vs transformers serve, one run.

Every peer is its own server process on loopback, all started before timing and left running;
the same OpenAI-client load generator (openai_load.py) sends each wave: `c` streamed completions
at once, the same text prompts for every peer within a repetition, exactly `output_len` greedy
tokens each. Waves run interleaved (peer A c=1, peer B c=1, ..., A c=8, ...; then the next
repetition), so slow drift of a shared machine falls on every peer alike.

Prompts are real English (LAMBADA passages, distinct per request and wave, cut to ~prompt_len
tokens): no two requests share a prefix, so no server's prompt cache can help. Several prompt
lengths (`--prompt-len 8192 16384 32768`) run as one more interleaved dimension: length, then
concurrency, then peer.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.openai_load import StreamedRequest, run_wave
from densa_bench.common.stats import interleave
from densa_bench.common.timing import Wave
from densa_bench.peers.servers import PeerServer, PeerSpec

logger = get_logger(__name__)


@dataclass(frozen=True)
class PeersSettings:
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 300
    output_len: int = 64
    # Several prompt lengths in one run (the first is prompt_len); empty: prompt_len only.
    prompt_lens: tuple[int, ...] = ()
    repeats: int = 2
    warmup: int = 1  # untimed waves per peer at the highest concurrency before timing
    prompt_seed: int = 0
    threads: int = 2
    wave_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if min(self.lengths) < 8 or self.output_len < 2:
            raise ValueError("--prompt-len must be >= 8 and --output-len >= 2")
        if self.repeats < 1 or self.warmup < 0 or self.threads < 1:
            raise ValueError("--repeats and --threads must be >= 1, --warmup >= 0")

    @property
    def lengths(self) -> tuple[int, ...]:
        """The prompt lengths the run measures, in order."""
        return self.prompt_lens or (self.prompt_len,)


class PromptMaker:
    """Distinct text prompts of ~prompt_len tokens: passages joined, cut at a token boundary.

    encode/decode are the model's tokenizer (every peer serves the same one), so a prompt's
    length is known in tokens; servers re-tokenize the text and may differ by a token or two,
    which their usage reports show."""

    def __init__(
        self,
        passages: Sequence[str],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        settings: PeersSettings,
    ) -> None:
        if not passages:
            raise ValueError("no text to build prompts from")
        self.passages, self.encode, self.decode = list(passages), encode, decode
        self.settings = settings

    def prompts(self, count: int, wave_key: str, length: int | None = None) -> list[str]:
        rng = random.Random(f"{self.settings.prompt_seed}/{wave_key}")
        return [self._one(rng, length or self.settings.prompt_len) for _ in range(count)]

    def _one(self, rng: random.Random, length: int) -> str:
        token_ids: list[int] = []
        while len(token_ids) < length:
            token_ids += self.encode(rng.choice(self.passages) + "\n\n")
        return self.decode(token_ids[:length])


@dataclass
class PeerWave:
    """One timed wave of one peer, with what the client saw of each request."""

    wave: Wave
    requests: list[StreamedRequest]
    failed_attempts: list[str]  # errors of attempts before the one that counted (see timed_wave)
    load_average: tuple[float, float]  # 1-minute load average before and after: machine noise
    target_len: int = 0  # the prompt length asked for (the wave's prompt_len is what was sent)


def run_peers(
    specs: Sequence[PeerSpec], settings: PeersSettings, prompts: PromptMaker, log_dir: Path
) -> tuple[list[PeerWave], dict[str, dict[str, Any]]]:
    """Start every peer, warm each up, run the interleaved waves; stop every peer on the way
    out. Returns the waves and, per peer, what it is (engine, formats, command)."""
    servers = [PeerServer(spec, log_dir) for spec in specs]
    try:
        for server in servers:
            logger.info("starting %s", server.spec.name)
            started = time.perf_counter()
            server.start()
            logger.info("%s ready in %.1f s", server.spec.name, time.perf_counter() - started)
        _warm_up(servers, settings, prompts)
        waves = _timed_waves(servers, settings, prompts)
    finally:
        for server in servers:
            server.stop()
    return waves, {s.spec.name: _describe(s.spec) for s in servers}


def _warm_up(servers: list[PeerServer], settings: PeersSettings, prompts: PromptMaker) -> None:
    concurrency = max(settings.concurrency)
    for warmup_idx in range(settings.warmup):
        # The shortest length warms every code path; a long one would cost minutes per peer.
        batch = prompts.prompts(concurrency, f"warmup{warmup_idx}", min(settings.lengths))
        for server in servers:
            logger.info("warm-up %d: %s c=%d", warmup_idx + 1, server.spec.name, concurrency)
            run_wave(server.endpoint, batch, settings.output_len, settings.wave_timeout_s)


def _timed_waves(
    servers: list[PeerServer], settings: PeersSettings, prompts: PromptMaker
) -> list[PeerWave]:
    variants = [
        (n, c, server) for n in settings.lengths for c in settings.concurrency for server in servers
    ]
    schedule = interleave(variants, settings.repeats)
    waves = []
    with progress(len(schedule), "bench peers") as bar:
        for repeat_idx, (length, concurrency, server) in schedule:
            label = f"{server.spec.name} p={length} c={concurrency} rep {repeat_idx + 1}"
            bar.set_postfix_str(label)
            # The same key gives every peer the same prompts within a repetition (the single-
            # length key is the one earlier runs used).
            key = f"c{concurrency}-r{repeat_idx}"
            if len(settings.lengths) > 1:
                key = f"p{length}-{key}"
            batch = prompts.prompts(concurrency, key, length)
            waves.append(timed_wave(server, batch, settings, repeat_idx, length))
            bar.update()
            logger.info(
                "[%d/%d] %s: %.1f output tok/s in %.2f s",
                len(waves),
                len(schedule),
                label,
                waves[-1].wave.output_tok_s,
                waves[-1].wave.wall_s,
            )
    return waves


def timed_wave(
    server: PeerServer,
    batch: list[str],
    settings: PeersSettings,
    repeat_idx: int,
    target_len: int = 0,
) -> PeerWave:
    """One wave through the OpenAI client; every request must report output_len tokens.

    A wave whose stream breaks (transformers serve sometimes closes a stream early under load)
    is run once more from scratch; the error is kept in the raw samples, and a second failure
    ends the benchmark."""
    failures: list[str] = []
    load_before = _load_average()
    while True:
        start_rss = server.reset_peak_rss()
        start_s = time.perf_counter()
        try:
            requests = run_wave(
                server.endpoint, batch, settings.output_len, settings.wave_timeout_s
            )
            break
        except Exception as exc:  # any client or protocol error of this attempt
            failures.append(f"{type(exc).__name__}: {exc}")
            logger.warning("%s: wave failed (%s)%s", server.spec.name, failures[-1],
                           "; retrying once" if len(failures) == 1 else "")  # fmt: skip
            if len(failures) > 1:
                raise
    wall_s = time.perf_counter() - start_s
    counts = {r.completion_tokens for r in requests}
    if counts != {settings.output_len}:
        raise RuntimeError(
            f"{server.spec.name} produced {sorted(counts, key=str)} tokens per request, "
            f"not {settings.output_len}: its settings do not force the output length"
        )
    prompt_tokens = [r.prompt_tokens or 0 for r in requests]
    wave = Wave(
        engine=server.spec.name,
        concurrency=len(batch),
        repeat_idx=repeat_idx,
        prompt_len=round(sum(prompt_tokens) / len(prompt_tokens)),
        wall_s=wall_s,
        requests=[r.timing() for r in requests],
        peak_rss_bytes=server.peak_rss_bytes(),
        start_rss_bytes=start_rss,
        engine_stats={},
    )
    load = (load_before, _load_average())
    return PeerWave(wave, requests, failures, load, target_len or settings.prompt_len)


def _load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _describe(spec: PeerSpec) -> dict[str, Any]:
    return {"engine": spec.engine, "formats": spec.formats, "command": " ".join(spec.argv)}


def report_settings(settings: PeersSettings, extra: dict[str, Any]) -> dict[str, Any]:
    return {**asdict(settings), **extra}
