"""`densa bench speculative`: speculative decoding on and off, densa vs llama-server with a draft.

Every variant is its own server process (peers/servers.py), all started before timing: densa
without speculation, with prompt lookup (ngram), with the draft model, and llama-server with the
same draft (`-md`). One openai-client load generator sends each wave (`c` streamed completions
at once, exactly output_len greedy tokens each); waves run interleaved across variants, so slow
drift of a shared machine falls on all of them alike.

Two workloads, the prompts rendered with the model's chat template:
    code-edit  a source file (densa's own, cut at a line near prompt_len tokens) and the request
               to return it whole with one comment line added: the answer repeats the prompt,
               where prompt lookup and drafts shine;
    chat       a LAMBADA passage and the request to continue the story: fresh text.

Acceptance is read two ways: tokens per streamed event (densa streams each verified step as one
event, so this is 1 + the tokens accepted per step) and llama-server's own draft counters (the
`timings` of its last event).
"""

from __future__ import annotations

import dataclasses
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import densa
from densa.utils.logging import get_logger
from densa.utils.progress import progress
from densa_bench.common.stats import interleave
from densa_bench.peers.runner import PeersSettings, PeerWave, timed_wave
from densa_bench.peers.servers import PeerServer, PeerSpec
from densa_bench.peers.specs import DENSA_DEFAULT, SERVE_SH_ARGS, PeerContext, _densa, llama_cpp

logger = get_logger(__name__)

WORKLOADS = ("code-edit", "chat")
METHODS = ("off", "ngram", "draft", "ngram+draft", "llama.cpp-draft")
# Run unless --methods names others (ngram+draft is not measured yet: opt in).
DEFAULT_METHODS = ("off", "ngram", "draft", "llama.cpp-draft")
CODE_EDIT_ASK = (
    "Return the file above unchanged except for one new first line, the comment "
    "`# reviewed`. Write the whole file, nothing else."
)
CHAT_ASK = "Continue this story for a few paragraphs, in the same voice."
SOURCE_ROOT = Path(densa.__file__).resolve().parent  # densa/: the code-edit files


@dataclass(frozen=True)
class SpecBenchSettings:
    concurrency: tuple[int, ...] = (1, 4, 8, 32)
    workloads: tuple[str, ...] = WORKLOADS
    methods: tuple[str, ...] = DEFAULT_METHODS
    prompt_len: int = 320  # tokens of file or passage, before the chat template and the ask
    output_len: int = 64
    num_speculative_tokens: int = 4  # densa's k and llama-server's --spec-draft-n-max
    repeats: int = 1
    warmup: int = 1  # untimed waves per variant and workload, at c = 1
    prompt_seed: int = 0
    threads: int = 2
    wave_timeout_s: float = 1800.0
    # No new wave starts once this many seconds have passed since the servers were started
    # (a run given a fixed window reports the waves it finished); None: no limit.
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        unknown = set(self.workloads) - set(WORKLOADS) | set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown workloads or methods: {sorted(unknown)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.prompt_len < 16 or self.output_len < 2 or self.repeats < 1:
            raise ValueError("--prompt-len must be >= 16, --output-len >= 2, --repeats >= 1")

    def wave_settings(self) -> PeersSettings:
        """What peers.timed_wave reads: the output length and the wave timeout."""
        return PeersSettings(
            concurrency=self.concurrency, output_len=self.output_len,
            wave_timeout_s=self.wave_timeout_s, threads=self.threads,
        )  # fmt: skip


# ---- variants --------------------------------------------------------------------------------
def build_variants(
    settings: SpecBenchSettings, ctx: PeerContext, draft_gguf: Path
) -> list[PeerSpec]:
    """One server per method: densa as `densa serve` runs by default, plus its speculation
    options; llama-server with the same draft GGUF and the same most draft tokens."""
    k = str(settings.num_speculative_tokens)
    densa_args = {
        "off": [],
        "ngram": ["--speculative-method", "ngram", "--num-speculative-tokens", k],
        "draft": ["--speculative-model", str(draft_gguf), "--num-speculative-tokens", k],
        "ngram+draft": [
            "--speculative-method",
            "ngram+draft",
            "--speculative-model",
            str(draft_gguf),
            "--num-speculative-tokens",
            k,
        ],
    }
    specs = []
    for method in settings.methods:
        if method in densa_args:
            extra = ["--model", "{gguf}", *SERVE_SH_ARGS, *densa_args[method]]
            build = _densa(f"densa {method}", extra, DENSA_DEFAULT)
            specs.append(build(ctx))
        else:
            plain = llama_cpp(ctx)
            # A plain GGUF draft needs its type named (llama.cpp infers only MTP/EAGLE-style
            # drafts from the file); -td: the draft's threads (it runs in turn with the target).
            draft = ("-md", str(draft_gguf), "--spec-type", "draft-simple",
                     "--spec-draft-n-max", k, "-td", str(ctx.threads))  # fmt: skip
            specs.append(
                dataclasses.replace(
                    plain,
                    name="llama.cpp draft",
                    argv=(*plain.argv, *draft),
                    formats={**plain.formats, "draft": draft_gguf.name},
                )
            )
    return specs


# ---- prompts ---------------------------------------------------------------------------------
class SpecPrompts:
    """The two workloads' prompts: distinct per request and wave, the same for every variant."""

    def __init__(
        self,
        render: Callable[[str], str],  # user text -> the prompt through the chat template
        encode: Callable[[str], list[int]],
        passages: Sequence[str],
        settings: SpecBenchSettings,
    ) -> None:
        self.render, self.encode, self.settings = render, encode, settings
        self.passages = list(passages)
        self.sources = sorted(p for p in SOURCE_ROOT.rglob("*.py") if p.stat().st_size > 2000)

    def prompts(self, workload: str, count: int, wave_key: str) -> list[str]:
        rng = random.Random(f"{self.settings.prompt_seed}/{workload}/{wave_key}")
        make = self._code_edit if workload == "code-edit" else self._chat
        return [self.render(make(rng)) for _ in range(count)]

    def _code_edit(self, rng: random.Random) -> str:
        lines = rng.choice(self.sources).read_text().splitlines()
        start = rng.randrange(max(1, len(lines) // 2))
        kept: list[str] = []
        num_tokens = 0
        for line in lines[start:]:
            if num_tokens >= self.settings.prompt_len:
                break
            kept.append(line)
            num_tokens += len(self.encode(line + "\n"))
        return "```python\n" + "\n".join(kept) + "\n```\n\n" + CODE_EDIT_ASK

    def _chat(self, rng: random.Random) -> str:
        text = ""
        while len(self.encode(text)) < self.settings.prompt_len:
            text += rng.choice(self.passages) + "\n\n"
        return text.strip() + "\n\n" + CHAT_ASK


# ---- the run ---------------------------------------------------------------------------------
@dataclass
class SpecWave:
    workload: str
    peer_wave: PeerWave
    # densa's own counters over the wave, from /metrics: (proposed, accepted) tokens
    spec_counters: tuple[int, int] | None = None


def run_speculative(
    specs: Sequence[PeerSpec],
    settings: SpecBenchSettings,
    prompts: SpecPrompts,
    log_dir: Path,
    on_wave: Callable[[list[SpecWave], dict[str, dict[str, Any]]], None] | None = None,
) -> tuple[list[SpecWave], dict[str, dict[str, Any]]]:
    """Start every variant, warm each up on every workload, run the interleaved waves; stop
    every server on the way out. Returns the waves and, per variant, what it runs; `on_wave`
    sees the waves so far after each one (a long run keeps a report of what it measured)."""
    servers = [PeerServer(spec, log_dir) for spec in specs]
    wave_settings = settings.wave_settings()
    deadline = None if settings.time_budget_s is None else time.monotonic() + settings.time_budget_s
    try:
        for server in servers:
            started = time.perf_counter()
            server.start()
            logger.info("%s ready in %.1f s", server.spec.name, time.perf_counter() - started)
        for warmup_idx in range(settings.warmup):
            for workload in settings.workloads:
                batch = prompts.prompts(workload, 1, f"warmup{warmup_idx}")
                for server in servers:
                    timed_wave(server, batch, wave_settings, -1)
        described = {s.spec.name: _describe(s.spec) for s in servers}
        waves = _timed_waves(
            servers, settings, prompts, lambda w: on_wave(w, described) if on_wave else None,
            deadline,
        )  # fmt: skip
    finally:
        for server in servers:
            server.stop()
    return waves, described


def _timed_waves(
    servers: list[PeerServer],
    settings: SpecBenchSettings,
    prompts: SpecPrompts,
    on_wave: Callable[[list[SpecWave]], None],
    deadline: float | None = None,
) -> list[SpecWave]:
    # Concurrency outermost: a run cut short still has every variant at the levels it reached.
    variants = [
        (workload, c, server)
        for c in settings.concurrency
        for workload in settings.workloads
        for server in servers
    ]
    schedule = interleave(variants, settings.repeats)
    waves: list[SpecWave] = []
    wave_settings = settings.wave_settings()
    with progress(len(schedule), "bench speculative") as bar:
        for repeat_idx, (workload, concurrency, server) in schedule:
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("time budget spent: %d of %d waves run", len(waves), len(schedule))
                break
            label = f"{server.spec.name} {workload} c={concurrency} rep {repeat_idx + 1}"
            bar.set_postfix_str(label)
            # The same key gives every variant the same prompts within a repetition.
            batch = prompts.prompts(workload, concurrency, f"c{concurrency}-r{repeat_idx}")
            before = spec_counters(server)
            peer_wave = timed_wave(server, batch, wave_settings, repeat_idx)
            after = spec_counters(server)
            delta = (after[0] - before[0], after[1] - before[1]) if before and after else None
            waves.append(SpecWave(workload, peer_wave, delta))
            on_wave(waves)
            bar.update()
            logger.info(
                "[%d/%d] %s: %.1f output tok/s, %.2f tokens/event", len(waves), len(schedule),
                label, peer_wave.wave.output_tok_s, tokens_per_event(peer_wave),
            )  # fmt: skip
    return waves


def tokens_per_event(peer_wave: PeerWave) -> float:
    """Output tokens per streamed event with text: 1 + the tokens accepted per verifying step
    for densa (it streams a step's tokens as one event); llama-server streams token by token."""
    events = sum(len(r.event_s) for r in peer_wave.requests)
    tokens = sum(r.completion_tokens or 0 for r in peer_wave.requests)
    return tokens / events if events else 0.0


def spec_counters(server: PeerServer) -> tuple[int, int] | None:
    """densa's lifetime (proposed, accepted) speculative tokens from its /metrics; None for a
    server that does not report them."""
    if server.spec.engine != "densa":
        return None
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        for name in ("densa_spec_proposed_tokens", "densa_spec_accepted_tokens"):
            if line.startswith(name) and not line.startswith(f"{name}_created"):
                values[name] = int(float(line.split()[-1]))
    if len(values) < 2:
        return None
    return values["densa_spec_proposed_tokens"], values["densa_spec_accepted_tokens"]


def draft_counters(peer_wave: PeerWave) -> tuple[int, int] | None:
    """(drafted, accepted) tokens of the wave from llama-server's timings; None without them."""
    timings = [r.server_timings for r in peer_wave.requests if r.server_timings]
    if not timings:
        return None
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timings)
    return drafted, accepted


def _describe(spec: PeerSpec) -> dict[str, Any]:
    return {"engine": spec.engine, "formats": spec.formats, "command": " ".join(spec.argv)}
