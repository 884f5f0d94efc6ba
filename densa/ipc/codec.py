"""One explicit codec for the contract: MessagePack through msgspec, decoded into the message
types (a message of an unknown type, or with a field of the wrong type, is an error, not a
dict). Nothing is pickled, so neither side can make the other run code."""

from __future__ import annotations

import msgspec

from densa.ipc.messages import FromEngine, ToEngine

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)

DecodeError = msgspec.DecodeError


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
