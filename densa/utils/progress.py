"""Progress of a long measurement: a bar on a terminal, log lines elsewhere."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from densa.utils.logging import get_logger

logger = get_logger(__name__)


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

    def set_postfix_str(self, text: str) -> None:
        """What is running now, shown after the bar."""
        self._bar.set_postfix_str(text)

    def close(self) -> None:
        self._bar.close()


@contextlib.contextmanager
def progress(total: int, description: str, unit: str = "run") -> Iterator[Progress]:
    """Progress over `total` units of work; densa's log lines print above the bar."""
    with logging_redirect_tqdm(loggers=[logging.getLogger("densa")]):
        bar = Progress(total, description, unit)
        try:
            yield bar
        finally:
            bar.close()


def _is_tty() -> bool:
    return sys.stderr.isatty()
