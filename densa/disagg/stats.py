"""Counters of the KV agents, reported with the engine's stats (and on /metrics)."""

from __future__ import annotations

from collections import Counter

# Counter names, for /metrics and the docs (anything else is a bug).
COUNTERS = (
    "transfers_started",  # D: PrefillRequests sent / P: accepted
    "transfers_landed",  # D: pages written and acked
    "transfers_failed",  # D: requests ended with a transfer error / P: prefills that failed
    "transfers_aborted",  # AbortTransfer sent (D) or honoured (P)
    "late_transfers_dropped",  # D: KVPages for a transfer no longer waiting (aborted, timed out)
    "duplicate_messages_dropped",  # a message for a transfer already past that point
    "stale_writes_dropped",  # D: a landing refused by the page tags (counted as integrity too)
    "damaged_transfers",  # D: pages that failed their MAC in flight (a resend was asked)
    "resends",  # P: KVPages sent again from the held pages
    "resends_refused",  # P: KVResend past MAX_RESENDS for one transfer (a flood): ignored
    "unauthenticated_messages",  # a MAC that does not verify under the peer's session: dropped
    "misdirected_messages",  # D: an answer from a peer the transfer did not ask: dropped
    "invalid_pages",  # D: authentic pages that do not fit the model or the request: failed
    "peer_faults",  # an exception while handling a peer's message: that transfer failed
    "peer_unreachable",  # D: a prefill address the transport cannot use (or no room for it)
    "timeouts",  # any state's timeout firing
    "ack_timeouts",  # P: held pages released because no ack came
    "undecodable_messages",  # frames that are not a peer message
    "handshake_failures",  # peers refused (model or format mismatch)
    "bytes",  # page bytes sent (P) / landed (D)
    "pages",  # pages sent (P) / landed (D)
    "transfer_ms",  # D: PrefillRequest sent -> KVPages landed, summed
    "landing_ms",  # D: checking + converting + writing pages, summed
    "prefill_ms",  # P's own time per transfer, summed (as P reported it)
    "pack_ms",  # P: copying pages out of its cache, summed
    "mac_ms",  # computing (P) or verifying (D) the messages' MACs, summed
)


class AgentStats:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, name: str, amount: float = 1) -> None:
        assert name in COUNTERS, f"unknown disagg counter {name!r}"
        self.counts[name] += amount  # type: ignore[assignment]

    def snapshot(self, gauges: dict[str, int]) -> dict[str, float]:
        out = {name: float(self.counts.get(name, 0)) for name in COUNTERS}
        out.update({name: float(value) for name, value in gauges.items()})
        return out
