"""Logging setup shared by the CLI and the server: one format, request ids in the message."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


# The packages whose loggers print: the server's, and the benchmarks' and evaluations' beside it
# (densa_bench reports its progress through loggers of its own name).
LOGGER_ROOTS = ("densa", "densa_bench")


def configure_logging(level: str | None = None) -> None:
    """Configure the 'densa' and 'densa_bench' loggers once; DENSA_LOG_LEVEL overrides the
    default INFO."""
    level_name = (level or os.environ.get("DENSA_LOG_LEVEL", "INFO")).upper()
    for root in LOGGER_ROOTS:
        logger = logging.getLogger(root)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT))
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(level_name)
