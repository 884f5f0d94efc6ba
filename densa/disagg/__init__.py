"""Prefill/decode disaggregation: KV pages move from a prefill worker to a decode worker.

    messages.py    the peer protocol (typed msgspec messages; page bytes travel as raw frames)
    handshake.py   what two workers must share to exchange pages, and the check
    wire.py        packed pages <-> frames and their layout (worker/kv_io.py packs and lands)
    transport.py   the KVTransport protocol, an in-process and a ZeroMQ (TCP) implementation
    ports.py       what the agents need from their engine (engine/disagg_port.py implements it)
    faults.py      a KVTransport wrapper that drops, delays, duplicates, reorders, cuts, corrupts
    decode_side.py the decode worker's transfer state machine (it drives: pages first)
    decode_transfer.py  one transfer's state and record, as decode_side tracks it
    decode_peers.py     the prefill workers decode_side is connected to (handshake, MACs, sends)
    landing_checks.py   what authentic pages must still satisfy before they land
    prefill_side.py the prefill worker's state machine (runs prompts, holds pages until acked)

docs/disaggregation.md has the protocol, its state diagram and the failure semantics.
"""
