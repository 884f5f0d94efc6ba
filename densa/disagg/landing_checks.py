"""What authentic KV pages must still satisfy before the decode side lands them: an authentic
message can come from a faulty or hostile peer, so its pages, layout, first token, cached
tokens and logprobs are checked against the local model and the transfer's reservation."""

from __future__ import annotations

from densa.disagg import messages as m
from densa.disagg.handshake import index_geometry, page_geometry
from densa.disagg.ports import Reservation
from densa.disagg.wire import WireError, check_frames, split_frames

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
        parts = split_frames(message, frames)
        check_frames(message.layout, parts.pages, len(message.dest_page_ids))
        if message.mtp is not None:
            check_mtp_state(model, r, message.mtp, parts.mtp_pages, parts.mtp_hidden)
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


def check_layout(model: m.PeerModel, layout: m.WireLayout, num_layers: int | None = None) -> None:
    """The pages' shape must be this model's: [layers, parts, pages, heads, page, dim], i.e.
    [layers, 2 (K, V), pages, kv heads, page, head dim], or for latent attention (MLA)
    [layers, 1, pages, 1, page, kv_lora_rank + rope dim]. num_layers: other than the model's
    (the MTP layer's pages are one layer)."""
    shape = list(layout.shape)
    try:
        layers, parts, heads, dim = page_geometry(model.architecture)
    except (KeyError, TypeError) as exc:  # our own model's signature: a bug, not the peer's
        raise WireError(f"no page geometry for this model ({exc})") from exc
    layers = layers if num_layers is None else num_layers
    expected = [layers, parts, heads, model.page.page_size, dim]
    if len(shape) != 6 or shape[:2] + shape[3:] != expected:
        raise WireError(f"a layout of shape {shape[:8]} for this model's {expected}")
    check_index_layout(model, layout, num_layers)


def check_index_layout(model: m.PeerModel, layout: m.WireLayout, num_layers: int | None) -> None:
    """Index keys travel exactly where this model caches them (sparse attention), in the same
    pages: [indexer layers, 1, pages, blocks, page, block], in a format of their own (an MTP
    layer's pages: one layer, which runs its own indexer)."""
    index = index_geometry(model.architecture)
    if index is None:
        if layout.index is not None:
            raise WireError("index keys for a model without sparse attention")
        return
    if layout.index is None:
        raise WireError("pages without the index keys this model's sparse attention reads")
    shape = list(layout.index.shape)
    layers, parts, heads, dim = index
    layers = layers if num_layers is None else num_layers
    expected = [layers, parts, layout.shape[2], heads, model.page.page_size, dim]
    if shape != expected or layout.index.index is not None:
        raise WireError(f"index keys of shape {shape[:8]} for this model's {expected}")


def check_mtp_state(
    model: m.PeerModel,
    r: Reservation,
    state: m.MTPState,
    frames: list[memoryview],
    hidden: memoryview | None,
) -> None:
    """An MTP state must be one asked for, of the MTP layer's shape, cover exactly the prompt's
    positions but the last, and carry one float32 hidden state of the model's width."""
    if not r.with_mtp:
        raise WireError("an MTP state this transfer did not ask for")
    if state.num_positions != len(r.prompt_token_ids) - 1:
        raise WireError(
            f"an MTP state of {state.num_positions} positions for a prompt of "
            f"{len(r.prompt_token_ids)} tokens"
        )
    check_layout(model, state.layout, num_layers=1)
    check_frames(state.layout, frames, -(-state.num_positions // model.page.page_size))
    hidden_bytes = 4 * _int(model.architecture.get("hidden_size"))
    if hidden is None or hidden.nbytes != hidden_bytes:
        raise WireError(f"an MTP hidden state that is not {hidden_bytes} bytes")


def _int(value: object) -> int:
    return value if isinstance(value, int) else -1


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
