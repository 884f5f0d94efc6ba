"""What every evaluation shares: loading one engine per format, and progress reports."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from densa.engine.llm import LLM
from densa.eval.formats import Format
from densa.utils.logging import get_logger

logger = get_logger(__name__)

# A probe for "same tokenizer": formats must see identical token ids for their scores to pair.
_TOKENIZER_PROBE = "Quality must be shown, not assumed: 3.14159 naïve café ✓ <|im_start|>"


def load_formats(formats: Sequence[Format]) -> list[LLM]:
    """One in-process engine per format, in order; all must share the reference's tokenizer."""
    llms = []
    for fmt in formats:
        logger.info("loading format %r", fmt.label)
        llms.append(LLM(**vars(fmt.args)))
    check_same_tokenizer(formats, llms)
    return llms


def check_same_tokenizer(formats: Sequence[Format], llms: Sequence[LLM]) -> None:
    """Raise ValueError unless every engine tokenizes like the first (the reference)."""
    expected = llms[0].tokenizer.encode(_TOKENIZER_PROBE)
    for fmt, llm in zip(formats[1:], llms[1:], strict=True):
        if llm.tokenizer.encode(_TOKENIZER_PROBE) != expected:
            raise ValueError(
                f"format {fmt.label!r} tokenizes differently from the reference "
                f"{formats[0].label!r}: compare checkpoints of the same model"
            )


class Progress:
    """A bar on a terminal; elsewhere (CI logs, `2> file`) a log line every tenth of the work."""

    def __init__(self, total: int, description: str, unit: str) -> None:
        self.total, self.description, self.unit = total, description, unit
        self.done = 0
        self._next_log = 0.1
        self._bar = tqdm(
            total=total, desc=description, unit=unit, file=sys.stderr, disable=not _is_tty()
        )

    def update(self, count: int = 1) -> None:
        self.done += count
        self._bar.update(count)
        if self._bar.disable and self.done >= self._next_log * self.total:
            logger.info("%s: %d/%d %s", self.description, self.done, self.total, self.unit)
            self._next_log = (int(10 * self.done / self.total) + 1) / 10

    def close(self) -> None:
        self._bar.close()


@contextlib.contextmanager
def progress(total: int, description: str, unit: str) -> Iterator[Progress]:
    """Progress over `total` units of work; densa's log lines print above the bar."""
    with logging_redirect_tqdm(loggers=[logging.getLogger("densa")]):
        bar = Progress(total, description, unit)
        try:
            yield bar
        finally:
            bar.close()


def _is_tty() -> bool:
    return sys.stderr.isatty()
