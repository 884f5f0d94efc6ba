"""The engine's side of disaggregation: the KV agents (densa/disagg) wired to an LLMEngine.

`KVAgents.for_role` builds what a role needs: a prefill worker listens for decode workers and
runs their prompts (PrefillAgent); a decode worker reaches prefill workers named per request
(DecodeAgent). The engine core calls `poll` on every turn of its loop (idle or not, at least
every 100 ms), so every transfer deadline fires on time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import zmq

from densa.auth.frames import LinkKeys, link_secret
from densa.auth.secret import ClusterSecret
from densa.disagg import wire
from densa.disagg.decode_side import DecodeAgent
from densa.disagg.handshake import peer_model
from densa.disagg.messages import MTPState, PageFormat, PeerModel, PrefillRequest
from densa.disagg.ports import Landing, Reservation
from densa.disagg.prefill_side import REQUEST_PREFIX, PrefillAgent
from densa.disagg.transport import KVTransport, ZmqTransport
from densa.engine.llm_engine import LLMEngine
from densa.formats.kv_format import KVFormat
from densa.ipc.messages import RequestDelta
from densa.model.kv_pages import page_bytes
from densa.model.lineage import checkpoint_lineage
from densa.model.loader import resolve_model_dir
from densa.sched.output import KVLanding
from densa.spec.proposer import PromptState, PromptStates
from densa.utils.logging import get_logger

logger = get_logger(__name__)


def describe(engine: LLMEngine, role: str) -> PeerModel:
    """What this worker announces at the handshake: its model, and its pages' KVFormat."""
    kv_format = engine.runner.kv_format
    page_size = engine.config.cache.page_size
    size = page_bytes(engine.arch, page_size, kv_format.on_wire)
    page = PageFormat(*kv_format.wire_form, page_size, size)
    architecture = engine.arch.signature()
    lineage = checkpoint_lineage(resolve_model_dir(engine.config.model.model))
    return peer_model(
        architecture, engine.tokenizer.files, page, role, engine.weight_format, lineage
    )


def prompt_states(engine: LLMEngine) -> PromptStates | None:
    """The engine's proposer, where its state of a prompt crosses the split with the pages (an
    MTP layer's rows: Proposer.prompt_states)."""
    speculator = engine.speculator
    return None if speculator is None else speculator.proposer.prompt_states


class DecodePort:
    """DecodeEngine (disagg/decode_side.py) over an LLMEngine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def is_receiving(self, request_id: str) -> bool:
        return self.engine.scheduler.is_receiving(request_id)

    def reserve_remote(self, request_id: str) -> Reservation | None:
        reserved = self.engine.scheduler.reserve_remote(request_id)
        if reserved is None:
            return None
        request = reserved.request
        return Reservation(
            first_block=reserved.first_block,
            dest_page_ids=reserved.dest_page_ids,
            dest_tags=reserved.dest_tags,
            prompt_token_ids=request.prompt_token_ids,
            params=request.sampling_params,
            cache_scope=request.cache_scope,
            with_mtp=prompt_states(self.engine) is not None,
        )

    def land_remote(self, request_id: str, landing: Landing) -> str | None:
        """Queue the pages for the engine's next step, whose runner writes them (checking the
        destination tags again) before the step reads any page; the request then runs from its
        first token. Refused now, the request ended, if it no longer owns its pages alone; a
        refusal in the step ends it the same way (the agent has acked either way)."""
        kv_landing = KVLanding(
            request_id, landing.dest_page_ids, landing.dest_tags,
            wire.unpack(landing.layout, landing.frames), landing.first_token_id,
            landing.first_logprobs, landing.num_cached_tokens,
        )  # fmt: skip
        violation = self.engine.scheduler.queue_landing(kv_landing)
        if violation is None:
            if landing.mtp is not None and landing.mtp_frames:
                self.engine.queue_mtp_state(request_id, _mtp_state(landing.mtp, landing.mtp_frames))
            return None
        self.engine.integrity_stats.record(violation)
        self.engine.fail_request(request_id, violation.message)
        return violation.message

    def fail_remote(self, request_id: str, error: str) -> None:
        self.engine.fail_request(request_id, error)

    def release_held(self, request_id: str) -> None:
        self.engine.scheduler.release_held(request_id)


class PrefillPort:
    """PrefillEngine (disagg/prefill_side.py) over an LLMEngine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def start_prefill(self, request_id: str, request: PrefillRequest) -> str | None:
        params = dataclasses.replace(request.params, max_tokens=1)
        try:
            self.engine.add_request(
                request.prompt_token_ids, params, request_id=request_id,
                cache_scope=request.cache_scope, hold_pages=True,
            )  # fmt: skip
        except ValueError as exc:
            return f"kv_transfer_failed: the prefill worker refused the prompt: {exc}"
        return None

    def held_page_ids(self, request_id: str) -> list[int] | None:
        return self.engine.scheduler.held_page_ids(request_id)

    def pack(self, request_id: str, page_ids: list[int], request: PrefillRequest) -> wire.Packed:
        packed = wire.framed(self.engine.export_pages(request_id, page_ids))
        mtp = prompt_states(self.engine)
        if not request.with_mtp or mtp is None:
            return packed
        try:
            state = mtp.export_prompt(request_id, request.prompt_token_ids)
        except Exception:  # a pass of the MTP layer, outside the step's fault confinement
            # The state only lets D propose from its first step: the pages go without it.
            logger.exception("the MTP state of %s could not be made; sent without it", request_id)
            return packed
        if state is None or state.pages is None:
            return packed
        hidden = state.hidden.numpy().tobytes()
        return wire.with_mtp_state(packed, state.pages, state.num_positions, hidden)

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def release_held(self, request_id: str) -> None:
        self.engine.scheduler.release_held(request_id)
        if self.engine.speculator is not None:  # the MTP layer's pages of the prompt
            self.engine.speculator.release(request_id)


def _mtp_state(state: MTPState, frames: list[memoryview]) -> PromptState:
    """A checked MTP state (landing_checks.check_mtp_state) as the proposer lands it."""
    hidden = torch.frombuffer(bytearray(frames[-1]), dtype=torch.float32).reshape(1, -1)
    pages = wire.unpack(state.layout, frames[:-1])
    return PromptState(state.num_positions, hidden, [], pages)


class KVAgents:
    """The agents of one engine, by role ("both" has none).

    The KV link is authenticated with keys derived from the cluster secret (densa/auth/frames.py);
    without one there is no link at all, not even on loopback (docs/security.md): construction
    raises ValueError. An in-process pair (no port) passes a secret made for the pair."""

    def __init__(
        self,
        engine: LLMEngine,
        role: str,
        transport: KVTransport | None,
        timeout_s: float,
        listen: str | None = None,
        secret: ClusterSecret | None = None,
    ) -> None:
        self.engine = engine
        self.role = role
        self.transport = transport
        self.address = ""
        self.decode: DecodeAgent | None = None
        self.prefill: PrefillAgent | None = None
        if transport is None:
            return
        keys = LinkKeys(link_secret(role, secret))  # before any port is bound
        model = describe(engine, role)
        if role == "prefill":
            self.address = transport.listen(listen)
            port = PrefillPort(engine)
            self.prefill = PrefillAgent(port, transport, model, timeout_s, keys=keys)
        elif role == "decode":
            self.decode = DecodeAgent(DecodePort(engine), transport, model, timeout_s, keys=keys)

    @classmethod
    def for_role(
        cls,
        engine: LLMEngine,
        role: str,
        context: zmq.Context,
        listen: str,
        timeout_s: float,
        secret: ClusterSecret | None = None,
    ) -> KVAgents:
        transport = None
        if role != "both":
            transport = ZmqTransport(context, max_message_bytes(engine))
        return cls(engine, role, transport, timeout_s, listen, secret)

    def poll(self) -> bool:
        """Run the agents; whether anything happened. A fault outside any one message (those
        are confined by the agents) is logged and the loop goes on: no peer stops the engine."""
        happened = False
        try:
            if self.prefill is not None:
                happened = self.prefill.poll()
            if self.decode is not None:
                happened = self.decode.poll() or happened
        except Exception:
            logger.exception("the KV agents failed outside any transfer; the engine goes on")
            happened = True
        return happened

    def take_outputs(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """The deltas for the front: remote prefills' own outputs never leave the engine."""
        if self.prefill is not None:
            deltas = self.prefill.take_outputs(deltas)
        return [d for d in deltas if not d.request_id.startswith(REQUEST_PREFIX)]

    def is_busy(self) -> bool:
        return bool(
            (self.prefill is not None and self.prefill.is_busy())
            or (self.decode is not None and self.decode.is_busy())
        )

    def stats(self) -> dict[str, float]:
        agent = self.prefill or self.decode
        if agent is None:
            return {}
        gauges = agent.gauges()
        gauges["held_pages"] = self.engine.scheduler.num_held_pages
        return agent.stats.snapshot(gauges)

    def waitables(self) -> list[Any]:
        return [] if self.transport is None else self.transport.waitables()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def max_message_bytes(engine: LLMEngine) -> int:
    """The largest message a KV peer may send: a whole prompt's pages in the widest format
    (float32), plus room for headers (and an MTP state, where the engine proposes with one).
    Larger ones are cut off by ZeroMQ before buffering."""
    cache = engine.config.cache
    num_pages = -(-engine.config.scheduler.max_model_len // cache.page_size)
    widest = KVFormat.of("float32")
    size = num_pages * page_bytes(engine.arch, cache.page_size, widest) + (16 << 20)
    if prompt_states(engine) is not None:  # the MTP layer's pages (one layer) and a hidden state
        one_layer = dataclasses.replace(engine.arch, num_layers=1)
        size += num_pages * page_bytes(one_layer, cache.page_size, widest)
        size += 4 * engine.arch.hidden_size
    return size
