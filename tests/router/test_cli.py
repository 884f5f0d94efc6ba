"""`densa router` refuses bad flags in one line, before binding or contacting anything."""

from __future__ import annotations

import pytest

from densa.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give at least one --worker URL"),
        (["--prefill", "http://a:1"], "give at least one --worker URL"),
        (["--prefill", "http://a:1", "--worker", "http://b:2"], "--prefill and --decode come"),
        (["--worker", "localhost:8000"], "must start with http://"),
        (["--worker", "http://a:1", "--worker", "http://a:1"], "listed twice"),
        (["--worker", "http://a:1", "--max-attempts", "0"], "at least 1"),
        (["--worker", "http://a:1", "--prefix-weight", "-1"], "must be >= 0"),
    ],
)
def test_bad_flags_fail_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["router", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("densa router: error:")
