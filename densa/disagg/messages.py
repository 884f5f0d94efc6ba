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
page bytes are never re-encoded. A transfer is named by D's transfer id in every message.
"""

from __future__ import annotations

from typing import Any

import msgspec

from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams


class PageFormat(msgspec.Struct, frozen=True):
    """How one side stores K/V: what its pages hold and how many bytes one page takes."""

    kv_dtype: str  # "float32" | "bfloat16" | "float16" | "fp8_e4m3"
    kv_scales: str  # "dynamic" | "static" (fp8 only; "none" otherwise)
    page_size: int  # tokens per page
    page_bytes: int  # one page, all layers, K and V, scales included


class PeerModel(msgspec.Struct, frozen=True):
    """What two workers must share to hand K/V over: the model's shapes and tokenizer."""

    architecture: dict[str, Any]  # ArchConfig.signature(): layer and head shapes, vocab
    tokenizer_digest: str  # sha256 of the tokenizer's files
    page: PageFormat
    role: str
    weight_format: str = ""  # for logs: the formats differ on purpose


class PeerHello(msgspec.Struct, tag=True):
    model: PeerModel


class PeerWelcome(msgspec.Struct, tag=True):
    model: PeerModel
    error: str | None = None  # set: P refuses this peer (the same check D runs)


class PrefillRequest(msgspec.Struct, tag=True):
    transfer_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_scope: str
    first_block: int  # D already caches blocks [0, first_block): send only the rest
    dest_page_ids: list[int]  # D's pages for blocks first_block.. in order
    dest_tags: list[int]  # their tags when D allocated them; every write must carry them


class WireLayout(msgspec.Struct, frozen=True):
    """What the raw frames after a KVPages header hold: pages in the sender's KV format
    (densa.quant.kv_format.KVFormat(kv_dtype, kv_scales); densa/disagg/wire.py frames them).

    frame 1: values [num_layers, 2 (K, V), num_pages, num_kv_heads, page_size, head_dim]
             in the format's storage dtype (fp8 and int8 as their bytes)
    frame 2: formats with a scale per row only: [num_layers, 2, num_pages, heads, page_size]
             fp8 dynamic: int8 power-of-two exponents; int8: fp16 scales
    """

    kv_dtype: str  # KVFormat.name: float32 | bfloat16 | float16 | fp8_e4m3 | int8
    kv_scales: str  # KVFormat.scales: none | dynamic | static (fp8) | row (int8)
    shape: list[int]
    static_scales: list[list[float]] = []  # fp8 static: [num_layers][K scale, V scale]
    checksums: list[int] = []  # crc32 of each raw frame, to detect damage in flight


class KVPages(msgspec.Struct, tag=True):
    transfer_id: str
    dest_page_ids: list[int]
    dest_tags: list[int]
    layout: WireLayout
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    num_cached_tokens: int  # prompt tokens P served from its own prefix cache
    prefill_ms: float  # P's time from PrefillRequest to KVPages (queue + compute + packing)


class PrefillFailed(msgspec.Struct, tag=True):
    transfer_id: str
    error: str


class KVAck(msgspec.Struct, tag=True):
    transfer_id: str


class KVResend(msgspec.Struct, tag=True):
    transfer_id: str


class AbortTransfer(msgspec.Struct, tag=True):
    transfer_id: str


class AbortAck(msgspec.Struct, tag=True):
    transfer_id: str


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
    """Raises DecodeError on anything that is not exactly one of the messages above."""
    return _decoder.decode(data)
