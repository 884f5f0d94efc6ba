"""`densa serve --kv-tier ...` end to end, through the official openai client: a prefix evicted
from a small device pool comes back from disk (usage's cached_tokens counts it, /metrics shows
the tier's hits, the answer is the same), and it survives the server being killed with SIGKILL:
a new server on the same directory answers the returning prompt from disk at once (its
directory key survived too). The shared store's password reaches the engine and is shown
nowhere."""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from densa.auth.secret import SECRET_ENV, ClusterSecret
from densa_bench.common.local_workers import WorkerProcess, WorkerSettings, running_workers
from densa_bench.common.redis_server import INSTALL_HINT, RedisServer, redis_server_binary

PAGE = 16
PROMPT_TOKENS = 100  # 6 full pages; the last token is always computed


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(300, 20000) for _ in range(PROMPT_TOKENS)] for _ in range(4)]


@contextlib.contextmanager
def _server(model: Path, tier_dir: Path, logs: Path) -> Iterator[WorkerProcess]:
    # 16 pages of 16 tokens: one prompt takes 7, so the three others evict the first one's pages.
    extra = ("--num-kv-pages", "16", "--page-size", str(PAGE), "--max-num-seqs", "1",
             "--kv-tier", f"disk:{tier_dir}:64MiB")  # fmt: skip
    settings = WorkerSettings(model=str(model), max_model_len=256, extra_args=extra)
    with running_workers(settings, 1, logs) as (worker,):
        yield worker


def _complete(worker: WorkerProcess, prompt: list[int]) -> tuple[str, int]:
    api = openai.OpenAI(base_url=worker.url + "/v1", api_key="none", max_retries=0, timeout=60)
    answer = api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens or 0


def _tier_counter(worker: WorkerProcess, counter: str) -> float:
    metrics = httpx.get(worker.url + "/metrics", timeout=10).text
    pattern = rf'^densa_kv_tier\{{counter="{counter}",tier="disk:[^"]+"\}} (\S+)$'
    (value,) = re.findall(pattern, metrics, flags=re.MULTILINE)
    return float(value)


def test_an_evicted_prefix_comes_back_from_disk_even_after_a_kill_9(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first, *others = _prompts()
    tier_dir = tmp_path / "tier"
    (tmp_path / "logs-1").mkdir()
    (tmp_path / "logs-2").mkdir()
    with _server(tiny_model_dir, tier_dir, tmp_path / "logs-1") as worker:
        original, cached = _complete(worker, first)
        assert cached == 0
        for other in others:  # the first prompt's pages are reused by these
            _complete(worker, other)
        again, cached = _complete(worker, first)
        assert again == original
        assert cached == 6 * PAGE  # every full page of the first prompt, from disk
        assert _tier_counter(worker, "hits") == 6
        assert _tier_counter(worker, "rejected") == 0
        assert _tier_counter(worker, "blocks_written") >= 4 * 6
        worker.kill_9()  # no shutdown, no flush: only what was already on disk survives
    with _server(tiny_model_dir, tier_dir, tmp_path / "logs-2") as restarted:
        after_restart, cached = _complete(restarted, first)
        assert after_restart == original
        assert cached == 6 * PAGE
        assert _tier_counter(restarted, "hits") == 6


PASSWORD = "planted-store-password-6f1c"


def test_the_stores_password_is_in_no_label_log_line_or_engine_command_line(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--kv-tier shared:redis://:PASSWORD@...` against a real redis-server that requires it:
    the pages come back from the store (so the password reached the engine process), and
    nothing a local user or a monitoring client can read shows it: /metrics (the tier's label
    is the store's scheme and host), the other open endpoints, the worker's log (front and
    engine), the engine process' command line."""
    if redis_server_binary() is None:
        pytest.skip(INSTALL_HINT)
    monkeypatch.setenv(SECRET_ENV, ClusterSecret.generate().value.decode())
    first, *others = _prompts()
    with RedisServer(maxmemory="32mb", password=PASSWORD) as store:
        tier = f"shared:redis://:{PASSWORD}@127.0.0.1:{store.port}/0"
        extra = ("--num-kv-pages", "16", "--page-size", str(PAGE), "--max-num-seqs", "1",
                 "--kv-tier", tier)  # fmt: skip
        settings = WorkerSettings(model=str(tiny_model_dir), max_model_len=256, extra_args=extra)
        with running_workers(settings, 1, tmp_path) as (worker,):
            for prompt in (first, *others):
                _complete(worker, prompt)
            _, cached = _complete(worker, first)
            assert cached == 6 * PAGE  # every full page, from the store
            engine_pid = httpx.get(worker.url + "/health", timeout=10).json()["engine_pid"]
            command_line = Path(f"/proc/{engine_pid}/cmdline").read_bytes()
            readable = {path: httpx.get(worker.url + path, timeout=10).text
                        for path in ("/metrics", "/health", "/densa/info", "/densa/load")}  # fmt: skip
    assert b"densa.engine.core_process" in command_line
    assert PASSWORD.encode() not in command_line
    assert f'tier="shared:redis://127.0.0.1:{store.port}"' in readable["/metrics"]
    assert not [path for path, text in readable.items() if PASSWORD in text]
    log = worker.log.read_text()
    assert PASSWORD not in log
    assert "--kv-tier-password-file" in log  # the warning that `ps` shows the front's options
