"""The peer protocol between a decode worker (D, which drives) and a prefill worker (P).

    D -> P  PeerHello        once per connection: D's model and page format
    P -> D  PeerWelcome      P's model and format, or why it refuses D
    D -> P  PrefillRequest   run this prompt; write its K/V into these destination pages (and tags)
    P -> D  KVPages          the pages (raw frames after this header) and the first token
    P -> D  PrefillFailed    P could not run it (the request fails on D with this reason)
    D -> P  KVAck            landed (or dropped): P may free its source pages
    D -> P  KVResend         the frames arrived damaged: send them again from the held pages
    D -> P  AbortTransfer    D no longer wants it (client gone, timeout)
    P -> D  AbortAck         P has stopped and freed its side: D may free the destination pages

Every message is one msgspec header frame, followed (KVPages only) by the raw page buffers, so
page bytes are never re-encoded, and last by a MAC frame over all of them (densa/auth/frames.py).
A transfer is named by D's transfer id in every message.

Decoding is bounded: every field has a type without open recursion (a peer cannot nest a message
a thousand levels deep), lists and strings have maximum lengths, and the whole message has a
maximum size on the socket (transport.py). Values are then checked against the local model and
the transfer they claim to answer by the agents, never trusted as sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams


class PageFormat(msgspec.Struct, frozen=True):
    """How one side stores K/V: what its pages hold and how many bytes one page takes."""

    kv_dtype: str  # "float32" | "bfloat16" | "float16" | "fp8_e4m3"
    kv_scales: str  # "dynamic" | "static" (fp8), "row" (int8); "none" otherwise
    page_size: int  # tokens per page
    page_bytes: int  # one page, all layers, K and V, scales included


# Bounds on what a peer may send (far above any real value; they only stop a hostile size).
MAX_TOKENS = 1 << 22  # prompt tokens in one PrefillRequest
MAX_PAGES = 1 << 20  # destination pages of one transfer
Id = Annotated[str, msgspec.Meta(max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Pages = Annotated[list[int], msgspec.Meta(max_length=MAX_PAGES)]
# ArchConfig.signature(): flat scalars plus the moe / mla parts (one level of nesting, no more).
Scalar = int | float | str | bool | None
Architecture = Annotated[
    dict[str, Scalar | dict[str, Scalar | Annotated[list[bool], msgspec.Meta(max_length=4096)]]],
    msgspec.Meta(max_length=64),
]


class PeerModel(msgspec.Struct, frozen=True):
    """What two workers must share to hand K/V over: the model's shapes and tokenizer."""

    architecture: Architecture  # layer and head shapes, vocab (ArchConfig.signature())
    tokenizer_digest: Id  # sha256 of the tokenizer's files
    page: PageFormat
    role: Id
    weight_format: Text = ""  # for logs: the formats differ on purpose
    # The checkpoint the weights come from (densa.model.lineage): an FP8 release and its INT4
    # conversion share it; "" = not announced (not checked).
    lineage: Id = ""


class PeerHello(msgspec.Struct, tag=True):
    model: PeerModel
    nonce: Nonce  # D's half of the session key (densa/auth/frames.py)


class PeerWelcome(msgspec.Struct, tag=True):
    model: PeerModel
    nonce: Nonce  # P's half of the session key
    error: Text | None = None  # set: P refuses this peer (the same check D runs)


class PrefillRequest(msgspec.Struct, tag=True):
    transfer_id: Id
    prompt_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_TOKENS)]
    params: SamplingParams
    cache_scope: Text
    first_block: int  # D already caches blocks [0, first_block): send only the rest
    dest_page_ids: Pages  # D's pages for blocks first_block.. in order
    dest_tags: Pages  # their tags when D allocated them; every write must carry them
    # D proposes with the checkpoint's MTP layer: send that layer's state of the prompt too
    # (MTPState), if P runs the layer.
    with_mtp: bool = False


class WireLayout(msgspec.Struct, frozen=True):
    """What the raw frames after a KVPages header hold: pages in the sender's KV format
    (KVFormat.from_wire(kv_dtype, kv_scales), densa.formats.kv_format; densa/disagg/wire.py
    frames them).

    frame 1: values [num_layers, 2 (K, V), num_pages, num_kv_heads, page_size, head_dim]
             in the format's storage dtype (fp8 and int8 as their bytes)
    frame 2: formats with a scale per row only: [num_layers, 2, num_pages, heads, page_size]
             fp8 dynamic: int8 power-of-two exponents; int8: fp16 scales
    then, for sparse attention (DSA), the same pages' index keys as `index` lays them out:
    [indexer layers, 1, num_pages, blocks, page_size, block], and their block scales
    """

    kv_dtype: Annotated[str, msgspec.Meta(max_length=32)]  # KVFormat.name: float32 | bfloat16 |
    # float16 | fp8_e4m3 | int8
    kv_scales: Annotated[str, msgspec.Meta(max_length=32)]  # KVFormat.scales: none | dynamic |
    # static (fp8) | row (int8)
    shape: Annotated[list[int], msgspec.Meta(max_length=8)]
    # fp8 static: [num_layers][K scale, V scale]
    static_scales: Annotated[
        list[Annotated[list[float], msgspec.Meta(max_length=2)]], msgspec.Meta(max_length=4096)
    ] = []
    index: WireLayout | None = None  # sparse attention's index keys of the same pages
    # (No checksums: the message's MAC covers every frame, damage and forgery alike.)


class MTPState(msgspec.Struct, frozen=True):
    """The MTP layer's state of a prompt of n tokens (docs/speculative.md, "Prefill/decode
    split"), in the frames after the target's pages:

    frames (layout): the layer's latent K/V rows of positions [0, num_positions), one layer
                     of pages [1, num_parts, pages, heads, page_size, dim]; num_positions = n - 1
    last frame:      h_{n-1}, the target's final hidden state of the last prompt position,
                     float32 [hidden_size] (the row at n - 1 pairs it with the first token)
    """

    layout: WireLayout
    num_positions: int


class KVPages(msgspec.Struct, tag=True):
    transfer_id: Id
    dest_page_ids: Pages
    dest_tags: Pages
    layout: WireLayout
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens P served from its own prefix cache
    prefill_ms: float  # P's time from PrefillRequest to KVPages (queue + compute + packing)
    mtp: MTPState | None = None  # only when D asked (with_mtp) and P runs the MTP layer


class PrefillFailed(msgspec.Struct, tag=True):
    transfer_id: Id
    error: Text


class KVAck(msgspec.Struct, tag=True):
    transfer_id: Id


class KVResend(msgspec.Struct, tag=True):
    transfer_id: Id


class AbortTransfer(msgspec.Struct, tag=True):
    transfer_id: Id


class AbortAck(msgspec.Struct, tag=True):
    transfer_id: Id


PeerMessage = (
    PeerHello
    | PeerWelcome
    | PrefillRequest
    | KVPages
    | PrefillFailed
    | KVAck
    | KVResend
    | AbortTransfer
    | AbortAck
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)
DecodeError = msgspec.DecodeError


def encode(message: PeerMessage) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> PeerMessage:
    """Raises DecodeError on anything that is not exactly one of the messages above (within
    its bounds)."""
    try:
        return _decoder.decode(data)
    except RecursionError as exc:  # the types bound nesting; this is a second fence
        raise DecodeError("a message nested too deeply") from exc


def decode_or_none(frames: Sequence[bytes | memoryview]) -> PeerMessage | None:
    """The header frame decoded, or None for no frames or anything `decode` refuses."""
    try:
        return decode(frames[0]) if frames else None
    except DecodeError:
        return None
