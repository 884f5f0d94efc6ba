"""Start-up errors are one clear line (what, and what to do), checked before the model loads;
the traceback only with --debug."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from densa.auth.secret import SECRET_ENV


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}  # no secret unless given
    return subprocess.run(
        [sys.executable, "-m", "densa.cli", *args], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 2, result.stderr
    # Log lines and progress bars may come first; the error itself must be one line, the last.
    lines = result.stderr.strip().splitlines()[-2:]
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("densa serve: error: "), lines
    assert lines[-1].startswith("(run `densa --debug"), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "loading the model" not in result.stderr + result.stdout
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--model", "/no/such/model"], ["/no/such/model", "no such file"]),
        (["--kv-cache-memory", "abc"], ["--kv-cache-memory", "'4GiB'"]),
        (["--kv-cache-memory", "0"], ["positive"]),
        (["--kv-cache-memory", "1.5"], ["(0, 1]", "1.5GiB"]),
        (["--kv-cache-memory", "1000"], ["no unit"]),
        (["--max-num-seqs", "0"], ["--max-num-seqs"]),
        # The trust boundary (docs/security.md): no cluster secret, no KV link -- not even on
        # loopback, where any local process could run prompts under any cache scope.
        (["--role", "prefill"], ["--role prefill needs the cluster secret"]),
        (["--role", "prefill", "--kv-listen", "tcp://127.0.0.1:0"], ["--role prefill", "secret"]),
        (["--role", "prefill", "--kv-listen", "tcp://0.0.0.0:0"], ["--role prefill", "secret"]),
        (["--role", "decode"], ["--role decode needs the cluster secret"]),
        (["--role", "decode", "--prefill-peer", "http://p:1/x"], ["--prefill-peer", "a path"]),
        (["--cluster-secret-file", "/no/such/secret"], ["cannot read the cluster secret"]),
        (["--reasoning-parser", "o1"], ["--reasoning-parser 'o1'", "deepseek_r1, glm45"]),
        (["--chat-template", "/no/such/t.jinja"], ["--chat-template /no/such/t.jinja", "No such"]),
    ],
)
def test_bad_options_fail_in_one_line_before_loading(args: list[str], needles: list[str]) -> None:
    assert_one_line_error(serve("serve", *args), *needles)


def test_a_busy_port_fails_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert_one_line_error(serve("serve", "--port", port), f"127.0.0.1:{port}", "--port")


def test_kv_budgets_that_cannot_work_fail_before_loading(tiny_model_dir: Path) -> None:
    model = ["--model", str(tiny_model_dir), "--max-model-len", "512"]
    small = assert_one_line_error(serve("serve", *model, "--kv-cache-memory", "1KiB"))
    assert "raise --kv-cache-memory or lower --max-model-len" in small
    huge = assert_one_line_error(serve("serve", *model, "--kv-cache-memory", "999TiB"))
    assert "free" in huge and "lower it" in huge


def test_a_truncated_model_file_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 40)
    line = assert_one_line_error(serve("serve", "--model", str(broken)))
    assert "broken.gguf" in line and "truncated" in line


def test_debug_shows_the_traceback() -> None:
    result = serve("--debug", "serve", "--kv-cache-memory", "abc")
    assert result.returncode != 0
    assert "Traceback" in result.stderr


def test_a_model_that_cannot_fit_fails_in_one_line_before_loading(tiny_model_dir: Path) -> None:
    """The memory check (densa/setup/memory_plan.py): a page count no machine holds."""
    model = ["--model", str(tiny_model_dir), "--max-model-len", "512"]
    line = assert_one_line_error(serve("serve", *model, "--num-kv-pages", "1000000000"))
    assert "not enough memory" in line and "is available (MemAvailable" in line
    assert "--kv-cache-memory" in line and "--skip-memory-check" in line


def test_served_model_names_are_the_engines_name_then_aliases() -> None:
    from densa.cli import build_parser
    from densa.setup.args import EngineArgs

    ns = build_parser().parse_args(["serve", "--served-model-name", "main", "alias"])
    assert ns.served_model_name == ["main", "alias"]  # the front serves both
    assert EngineArgs.from_cli(ns).served_model_name == "main"  # the engine knows the first
