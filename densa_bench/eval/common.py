"""What every evaluation shares: loading one engine per format."""

from __future__ import annotations

from collections.abc import Sequence

from densa.engine.llm import LLM
from densa.utils.logging import get_logger
from densa_bench.eval.formats import Format

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
