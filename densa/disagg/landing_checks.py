"""What authentic KV pages must still satisfy before the decode side lands them: an authentic
message can come from a faulty or hostile peer, so its pages, layout, first token, cached
tokens and logprobs are checked against the local model and the transfer's reservation."""

from __future__ import annotations

from densa.disagg import messages as m
from densa.disagg.ports import Reservation
from densa.disagg.wire import WireError, check_frames

BAD_PEER = "kv_transfer_failed: the prefill worker sent"


def invalid_pages(
    model: m.PeerModel,
    vocab_size: int,
    r: Reservation,
    message: m.KVPages,
    frames: list[memoryview],
) -> str | None:
    """Why authentic pages still cannot land (the peer is faulty or hostile), or None."""
    try:
        if message.dest_page_ids != r.dest_page_ids or message.dest_tags != r.dest_tags:
            raise WireError("the pages name other destinations than this transfer reserved")
        check_layout(model, message.layout)
        check_frames(message.layout, frames, len(message.dest_page_ids))
    except WireError as exc:
        return f"{BAD_PEER}: unusable pages ({exc})"
    if not 0 <= message.first_token_id < vocab_size:
        return f"{BAD_PEER}: a first token outside the vocabulary"
    if not 0 <= message.num_cached_tokens <= len(r.prompt_token_ids):
        return f"{BAD_PEER}: more cached tokens than the prompt has"
    logprobs = message.first_logprobs
    if logprobs is not None and not logprobs_fit(logprobs, r, vocab_size):
        return f"{BAD_PEER}: logprobs this request cannot have"
    return None


def check_layout(model: m.PeerModel, layout: m.WireLayout) -> None:
    """The pages' shape must be this model's: [layers, 2, pages, kv heads, page, head dim]."""
    arch, shape = model.architecture, list(layout.shape)
    expected = [arch.get("num_layers"), 2, arch.get("num_kv_heads"),
                model.page.page_size, arch.get("head_dim")]  # fmt: skip
    if len(shape) != 6 or shape[:2] + shape[3:] != expected:
        raise WireError(f"a layout of shape {shape[:8]} for this model's {expected}")


def logprobs_fit(logprobs: m.TokenLogprobs, r: Reservation, vocab_size: int) -> bool:
    """The first token's logprobs name tokens of the vocabulary, no more of them than asked."""
    ids = [logprobs.token_id, *(token_id for token_id, _ in logprobs.top)]
    return len(logprobs.top) <= max(r.params.logprobs or 0, 0) and all(
        0 <= token_id < vocab_size for token_id in ids
    )


def peer_error(error: str) -> str:
    """A prefill worker's error as the client may see it: one line, printable, bounded."""
    text = "".join(c if c.isprintable() else " " for c in error)[:300]
    known = text.startswith(("kv_", "invalid_", "engine_"))
    return text if known else f"kv_transfer_failed: {text}"
