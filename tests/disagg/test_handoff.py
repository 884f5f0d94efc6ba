"""The handoff between two in-process engines, step by step: exact destination pages and tags,
the states on both sides, every timeout, and the faults of a real network (fake transport)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from densa.cache.integrity import ViolationKind
from densa.disagg import wire
from densa.disagg.decode_transfer import DecodeState
from densa.disagg.faults import Fault, FaultyTransport
from densa.disagg.ports import Landing
from densa.disagg.prefill_side import PrefillState
from densa.disagg.transport import KVTransport
from densa.engine.disagg_port import DecodePort
from densa.formats import fp8_kv, int8_kv
from densa.sampling_params import SamplingParams

from .support import Pair, colocated_tokens, make_pair

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(40)]  # 40 tokens: pages of 16 -> 3 pages
SMALL = {
    "num_kv_pages": 16,
    "max_model_len": 128,
}  # a small pool: page ids and tags are predictable
TIMEOUT_S = 5.0
LAYERS_OF_TINY = 2  # the tiny model: 2 layers, 2 KV heads, head_dim 16


def faulty(side: str, *faults: Fault) -> Any:
    """wrap= for make_pair: faults on what `side` sends."""

    def wrap(transport: KVTransport, which: str) -> KVTransport:
        return FaultyTransport(transport, list(faults)) if which == side else transport

    return wrap


def pair_with(model_dir: Path, wrap: Any = None, **kwargs: Any) -> Pair:
    pair = make_pair(model_dir, SMALL, SMALL, timeout_s=TIMEOUT_S, wrap=wrap, **kwargs)
    for side in (pair.p_agents, pair.d_agents):
        transport = side.transport
        if isinstance(transport, FaultyTransport):
            transport.clock = pair.clock
    return pair


def transfer_of(pair: Pair, request_id: str = "r") -> Any:
    return next(t for t in pair.d_agent.transfers.values() if t.request_id == request_id)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[int]:
    return colocated_tokens(tiny_model_dir, [PROMPT], GREEDY, **SMALL)[0]


def test_destination_pages_are_allocated_and_tagged_before_any_byte_moves(
    tiny_model_dir: Path, expected: list[int]
) -> None:
    pair = pair_with(tiny_model_dir)
    pair.submit(PROMPT, GREEDY, "r")
    transfer = transfer_of(pair)
    assert transfer.state == DecodeState.WAITING_PEER
    pair.turn(run_prefill=False)  # handshake, then D reserves and asks
    assert transfer.state == DecodeState.REQUESTED
    reservation = transfer.reservation
    # A fresh pool hands out pages 0, 1, 2; allocating bumps each tag by num_pages (16).
    assert reservation.first_block == 0
    assert reservation.dest_page_ids == [0, 1, 2]
    assert reservation.dest_tags == [16, 17, 18]
    assert pair.decode.kv_manager.num_free_pages == 13
    assert not pair.p_agent.transfers  # P has not even seen the request yet
    pair.turn(run_prefill=False)
    assert pair.p_agent.transfers[transfer.transfer_id].state == PrefillState.COMPUTING
    pair.run()
    assert pair.tokens("r") == expected
    assert transfer.history == [
        DecodeState.WAITING_PEER, DecodeState.WAITING_PAGES, DecodeState.REQUESTED,
    ]  # fmt: skip
    assert transfer.state == DecodeState.LANDED
    assert pair.d_agent.stats.counts["pages"] == 3
    pair.assert_all_free()


def test_prefill_holds_its_pages_until_acked_then_frees_them(tiny_model_dir: Path) -> None:
    pair = pair_with(tiny_model_dir, faulty("decode", Fault("delay", "KVAck", delay_s=1.0)))
    pair.submit(PROMPT, GREEDY, "r")
    for _ in range(3):
        pair.turn()
    p_transfer = next(iter(pair.p_agent.transfers.values()))
    assert p_transfer.state == PrefillState.HOLDING
    held = pair.prefill.scheduler.held[p_transfer.request_id][0]
    assert sorted(held) == [0, 1, 2]  # the prompt's pages, not freed while D may ask again
    assert pair.prefill.kv_manager.num_free_pages == 13
    pair.clock.now += 1.5  # the ack arrives (late but within the timeout)
    pair.run()
    assert p_transfer.state == PrefillState.RELEASED
    assert pair.p_agent.stats.counts["ack_timeouts"] == 0
    pair.assert_all_free()


@pytest.mark.parametrize("fault", ["drop", "delay"])
def test_an_ack_lost_or_later_than_the_timeout_frees_prefill_pages_on_the_timer(
    tiny_model_dir: Path, expected: list[int], fault: str
) -> None:
    pair = pair_with(tiny_model_dir, faulty("decode", Fault(fault, "KVAck", delay_s=3 * TIMEOUT_S)))
    pair.submit(PROMPT, GREEDY, "r")
    pair.run_until_answered("r")
    for _ in range(5):
        pair.turn()
    assert pair.tokens("r") == expected
    assert pair.p_agent.gauges()["in_holding"] == 1  # no ack yet: P still holds its pages
    pair.clock.now += TIMEOUT_S + 0.1
    pair.turn()  # no new request arrives: the timer alone frees them
    assert pair.p_agent.stats.counts["ack_timeouts"] == 1
    pair.clock.now += 3 * TIMEOUT_S
    pair.turn()  # a delayed ack now arrives: nothing left to free
    pair.assert_all_free()


def test_client_abort_mid_transfer_keeps_destination_pages_until_prefill_stops(
    tiny_model_dir: Path,
) -> None:
    pair = pair_with(tiny_model_dir, faulty("prefill", Fault("delay", "KVPages", delay_s=2.0)))
    pair.submit(PROMPT, GREEDY, "r")
    for _ in range(2):
        pair.turn()  # prefill computed and "sent" (the pages are on the wire, delayed)
    transfer = transfer_of(pair)
    assert transfer.state == DecodeState.REQUESTED
    pair.decode.abort_request("r")  # the client went away
    pair.turn()
    assert transfer.state == DecodeState.ABORTING
    # The request is gone, but P may still be writing: its pages are held, not free.
    assert pair.decode.scheduler.held["r"][0][::-1] == [0, 1, 2]
    assert pair.decode.kv_manager.num_free_pages == 13
    pair.turn()  # P answers the abort (it was holding): AbortAck -> D frees
    assert transfer.state == DecodeState.CLOSED
    assert pair.decode.kv_manager.num_free_pages == 16
    pair.clock.now += 2.5
    pair.turn()  # the delayed pages arrive: dropped, counted, never written
    assert pair.d_agent.stats.counts["late_transfers_dropped"] == 1
    assert pair.outputs["r"][-1].finish_reason == "abort"
    pair.run()
    pair.assert_all_free()


def test_a_late_write_onto_reallocated_pages_is_refused_by_the_tags(
    tiny_model_dir: Path,
) -> None:
    """P never answers the abort: past the abort timeout D frees the pages, a new request takes
    them; the late pages then arrive and must not land on the new owner."""
    wrap = faulty("prefill", Fault("delay", "KVPages", delay_s=4 * TIMEOUT_S))
    pair = pair_with(tiny_model_dir, wrap)
    pair.submit(PROMPT, GREEDY, "r")
    for _ in range(2):
        pair.turn()
    transfer = transfer_of(pair)
    reservation = transfer.reservation
    pair.p_agents.transport = None  # P goes silent (no AbortAck); its KVPages stay delayed
    pair.p_agent.transport.inner.hub.inboxes.clear()
    pair.decode.abort_request("r")
    pair.d_agents.poll()
    assert transfer.state == DecodeState.ABORTING
    pair.clock.now += TIMEOUT_S + 0.1
    pair.d_agents.poll()
    assert transfer.state == DecodeState.CLOSED
    # A new local request now owns the same pages, with new tags.
    pair.decode.add_request(PROMPT[:33], GREEDY, request_id="new")
    pair.decode.step()
    owner = pair.decode.scheduler.requests["new"]
    assert owner.page_ids == [2, 1, 0] or set(owner.page_ids) == {0, 1, 2}
    # The stale writer tries to land with the tags it was issued: refused, counted, and
    # nothing is queued for a step to write.
    packed = wire.pack_pages(pair.prefill.runner.kv_caches, [3, 4, 5])
    landing = Landing(reservation.dest_page_ids, reservation.dest_tags, packed.layout,
                      packed.frames, 1, None, 0)  # fmt: skip
    refused = DecodePort(pair.decode).land_remote("r", landing)
    assert refused is not None and "stale_write" in refused
    assert pair.decode.integrity_stats.counts[ViolationKind.STALE_WRITE] == 1
    assert not pair.decode.scheduler.remote.has_landings
    assert "new" in pair.decode.scheduler.requests  # the new owner is untouched


def test_a_landing_the_runner_finds_stale_is_dropped_and_ends_only_its_request(
    tiny_model_dir: Path,
) -> None:
    """The scheduler's tags let the landing through, the runner's table does not (they
    disagree: a bug, or corruption): the write is dropped at the step, the request ends with
    the violation, and a request running beside it is untouched."""
    pair = pair_with(tiny_model_dir, faulty("prefill", Fault("delay", "KVPages", delay_s=1.0)))
    pair.decode.add_request(PROMPT[:20], GREEDY, request_id="local")
    pair.submit(PROMPT, GREEDY, "r")
    for _ in range(2):
        pair.turn()
    reservation = transfer_of(pair).reservation
    page = reservation.dest_page_ids[1]
    table: Any = pair.decode.runner.integrity
    table.tags[page] += 1  # the runner's table disagrees about one page
    caches: Any = pair.decode.runner.kv_caches
    before = [c.k[page].clone() for c in caches]
    pair.clock.now += 1.5
    pair.run()
    final = pair.final("r")
    assert final.finish_reason == "error" and final.error_code == "kv_integrity_violation"
    assert pair.decode.integrity_stats.counts[ViolationKind.STALE_WRITE] == 1
    assert all(torch.equal(c.k[page], b) for c, b in zip(caches, before, strict=True))
    local = [t for d in pair.outputs.get("local", []) for t in d.new_token_ids]
    assert local == colocated_tokens(tiny_model_dir, [PROMPT[:20]], GREEDY, **SMALL)[0]
    for engine in (pair.prefill, pair.decode):
        assert not engine.scheduler.requests and not engine.scheduler.held
        assert engine.kv_manager.num_free_pages == engine.kv_manager.num_pages


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_pages_are_sent_again_from_the_held_copy(
    tiny_model_dir: Path, expected: list[int], damage: str
) -> None:
    pair = pair_with(tiny_model_dir, faulty("prefill", Fault(damage, "KVPages")))
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    assert pair.tokens("r") == expected
    assert pair.d_agent.stats.counts["damaged_transfers"] == 1
    assert pair.p_agent.stats.counts["resends"] == 1
    pair.assert_all_free()


def test_pages_damaged_every_time_fail_the_request_with_an_error(tiny_model_dir: Path) -> None:
    pair = pair_with(tiny_model_dir, faulty("prefill", Fault("corrupt", "KVPages", times=10)))
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    final = pair.final("r")
    assert final.finish_reason == "error" and "damaged" in (final.error or "")
    pair.assert_all_free()


@pytest.mark.parametrize(
    ("side", "message"),
    [("prefill", "KVPages"), ("decode", "PrefillRequest"), ("decode", "KVAck")],
)
def test_duplicate_messages_are_dropped_and_the_answer_is_unchanged(
    tiny_model_dir: Path, expected: list[int], side: str, message: str
) -> None:
    pair = pair_with(tiny_model_dir, faulty(side, Fault("duplicate", message)))
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    assert pair.tokens("r") == expected
    receiver = pair.d_agent if side == "prefill" else pair.p_agent
    assert receiver.stats.counts["duplicate_messages_dropped"] == 1
    assert pair.p_agent.stats.counts["transfers_started"] == 1  # never computed twice
    pair.assert_all_free()


def test_reordered_transfers_land_each_on_its_own_pages(tiny_model_dir: Path) -> None:
    prompts = [PROMPT, PROMPT[::-1][:35]]
    want = colocated_tokens(tiny_model_dir, prompts, GREEDY, **SMALL)
    pair = pair_with(tiny_model_dir, faulty("prefill", Fault("reorder", "KVPages")))
    for idx, prompt in enumerate(prompts):
        pair.submit(prompt, GREEDY, f"r{idx}")
    pair.run()
    assert [pair.tokens("r0"), pair.tokens("r1")] == want
    pair.assert_all_free()


def test_a_lost_prefill_request_times_out_with_an_error_and_frees_everything(
    tiny_model_dir: Path,
) -> None:
    pair = pair_with(tiny_model_dir, faulty("decode", Fault("drop", "PrefillRequest")))
    pair.submit(PROMPT, GREEDY, "r")
    pair.run(advance_s=0.5)
    final = pair.final("r")
    assert final.finish_reason == "error" and final.error_code == "kv_transfer_timeout"
    assert transfer_of(pair).history[-2:] == [DecodeState.REQUESTED, DecodeState.ABORTING]
    pair.assert_all_free()


def test_a_stuck_prefill_times_out_on_both_sides(tiny_model_dir: Path) -> None:
    """D's abort is lost too: each side's own timer ends the transfer."""
    pair = pair_with(tiny_model_dir, faulty("decode", Fault("drop", "AbortTransfer")))
    pair.submit(PROMPT, GREEDY, "r")
    for _ in range(30):  # the prefill engine never computes
        pair.turn(run_prefill=False)
        pair.clock.now += 0.5
    assert pair.final("r").error_code == "kv_transfer_timeout"
    assert pair.d_agent.stats.counts["timeouts"] == 1  # REQUESTED timed out on D
    assert pair.p_agent.stats.counts["timeouts"] == 1  # COMPUTING timed out on P
    pair.run()  # D's ABORTING closes on P's PrefillFailed
    pair.assert_all_free()


def test_no_free_pages_on_decode_is_a_timeout_error_not_a_hang(tiny_model_dir: Path) -> None:
    pair = pair_with(tiny_model_dir)
    for idx in range(6):  # 3 pages each: the sixth finds 1 free page of 16
        pair.submit(PROMPT, GREEDY, f"r{idx}")
    for _ in range(30):  # the prefill never computes: nobody lands, nobody frees
        pair.turn(run_prefill=False)
        pair.clock.now += 0.5
    assert transfer_of(pair, "r5").history[-1] == DecodeState.WAITING_PAGES
    assert pair.final("r5").error_code == "kv_transfer_timeout"
    assert "no KV pages" in (pair.final("r5").error or "")
    pair.run()
    pair.assert_all_free()


def test_abort_before_the_pages_exist_never_reaches_the_prefill(tiny_model_dir: Path) -> None:
    pair = pair_with(tiny_model_dir)
    pair.submit(PROMPT, GREEDY, "r")
    pair.decode.abort_request("r")
    pair.run()
    assert pair.p_agent.stats.counts["transfers_started"] == 0
    assert transfer_of(pair).state == DecodeState.CLOSED
    pair.assert_all_free()


def test_abort_while_prefill_computes_stops_it_and_frees_both_sides(tiny_model_dir: Path) -> None:
    pair = pair_with(tiny_model_dir)
    pair.submit(PROMPT, GREEDY, "r")
    pair.turn(run_prefill=False)
    pair.turn(run_prefill=False)  # P has queued the prompt, not computed it
    p_transfer = next(iter(pair.p_agent.transfers.values()))
    assert p_transfer.state == PrefillState.COMPUTING
    pair.decode.abort_request("r")
    pair.d_agents.poll()  # D: AbortTransfer
    pair.p_agents.poll()  # P: before its engine computes the prompt
    assert p_transfer.state == PrefillState.RELEASED
    pair.run()
    assert pair.p_agent.stats.counts["transfers_aborted"] == 1
    assert pair.d_agent.stats.counts["late_transfers_dropped"] == 0
    pair.assert_all_free()


def test_a_model_or_page_format_mismatch_is_a_clear_error(tiny_model_dir: Path) -> None:
    pair = make_pair(tiny_model_dir, {"page_size": 16}, {"page_size": 8}, timeout_s=TIMEOUT_S)
    pair.submit(PROMPT, GREEDY, "r")
    pair.run()
    final = pair.final("r")
    assert final.finish_reason == "error" and final.error_code == "kv_peer_mismatch"
    assert "page size: 8 here, 16 there" in (final.error or "")
    assert pair.d_agent.stats.counts["handshake_failures"] == 1
    pair.assert_all_free()


def test_only_missing_pages_move_when_decode_caches_part_of_the_prefix(
    tiny_model_dir: Path,
) -> None:
    pair = pair_with(tiny_model_dir)
    pair.submit(PROMPT, GREEDY, "first")
    pair.run()
    pair.submit([*PROMPT[:32], 11, 12, 13, 14, 15], GREEDY, "second")
    transfer = transfer_of(pair, "second")
    pair.turn(run_prefill=False)
    assert transfer.reservation.first_block == 2  # blocks 0 and 1 are cached on decode
    assert len(transfer.reservation.dest_page_ids) == 1
    pair.run()
    assert pair.d_agent.stats.counts["pages"] == 3 + 1
    # Both sides hit: decode holds 32 tokens, prefill (which computed "first") too.
    assert pair.final("second").num_cached_tokens == 32
    pair.assert_all_free()


def test_pages_arriving_right_after_an_abort_are_dropped_not_counted_as_violations(
    tiny_model_dir: Path,
) -> None:
    pair = pair_with(tiny_model_dir)
    pair.submit(PROMPT, GREEDY, "r")
    pair.turn()  # handshake; D reserves and asks
    pair.p_agents.poll()
    pair.p_agents.take_outputs(pair.prefill.step())  # P computes and ships the pages
    pair.decode.abort_request("r")  # the client leaves before D has seen them
    pair.run()
    assert pair.d_agent.stats.counts["late_transfers_dropped"] == 1
    assert pair.decode.integrity_stats.total == 0  # a refused write, not a violation
    pair.assert_all_free()


# ---- every KV format densa serves, on either side -----------------------------------------------
FORMAT_ARGS = {
    "float32": {"kv_cache_dtype": "float32"},
    "bfloat16": {"kv_cache_dtype": "bfloat16"},
    "float16": {"kv_cache_dtype": "float16"},
    "fp8-dynamic": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": "dynamic"},
    "fp8-static": {"kv_cache_dtype": "fp8_e4m3", "kv_scales": "static"},  # no file: scale 1.0
    "int8": {"kv_cache_dtype": "int8"},
}
# Each format is a source and a destination of a conversion at least once (a cycle), plus the
# reference split's own (BF16 -> FP8) and INT8's neighbours.
CONVERSIONS = [
    ("bfloat16", "int8"), ("int8", "fp8-dynamic"), ("fp8-dynamic", "float16"),
    ("float16", "fp8-static"), ("fp8-static", "float32"), ("float32", "int8"),
    ("int8", "bfloat16"), ("bfloat16", "fp8-dynamic"),
]  # fmt: skip


def test_the_handoff_formats_are_every_format_densa_serves() -> None:
    from densa.formats.kv_format import KVFormat
    from densa.setup.args import EngineArgs

    served = {(f.name, f.scales) for f in KVFormat.served()}
    args: list[Any] = list(FORMAT_ARGS.values())
    ours = {(f.name, f.scales) for f in (EngineArgs(model="x", **a).kv_format() for a in args)}
    assert ours == served
    assert {name for pair in CONVERSIONS for name in pair} == set(FORMAT_ARGS)
    assert {s for s, _ in CONVERSIONS} == {d for _, d in CONVERSIONS} == set(FORMAT_ARGS)


def landed_pair(model_dir: Path, source: str, dest: str) -> tuple[Pair, list[int], list[int]]:
    """A handoff from a `source`-format prefill to a `dest`-format decode worker, stopped right
    after the pages landed (P still holds its pages: the ack is late). Returns the pair, P's
    source pages and D's destination pages, in block order."""
    pair = make_pair(
        model_dir, {**SMALL, **FORMAT_ARGS[source]}, {**SMALL, **FORMAT_ARGS[dest]},
        timeout_s=TIMEOUT_S, wrap=faulty("decode", Fault("delay", "KVAck", delay_s=1.0)),
    )  # fmt: skip
    for side in (pair.p_agents, pair.d_agents):
        if isinstance(side.transport, FaultyTransport):
            side.transport.clock = pair.clock
    pair.submit(PROMPT, GREEDY, "r")
    transfer = transfer_of(pair)
    for _ in range(10):
        pair.turn()
        if transfer.state == DecodeState.LANDED and "r" in pair.outputs:
            break
    assert transfer.state == DecodeState.LANDED and pair.tokens("r")  # the first token is out
    p_request_id = next(iter(pair.p_agent.transfers.values())).request_id
    source_pages = pair.prefill.scheduler.held[p_request_id][0][::-1]
    return pair, source_pages, transfer.reservation.dest_page_ids


def prompt_slots(cache: Any, page_ids: list[int]) -> list[tuple[Any, Any]]:
    """(values, scales) of the prompt's token rows, per part: [tokens, heads, D] and
    [tokens, heads] (scales: None, a 0-dim static scale, or one per row)."""
    pages = torch.tensor([page_ids[p // 16] for p in range(len(PROMPT))])
    slots = torch.tensor([p % 16 for p in range(len(PROMPT))])
    out = []
    for values, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        rows = values[pages, :, slots]
        if scale is not None and scale.dim() > 0:
            scale = scale[pages, :, slots]
        out.append((rows, scale))
    return out


def reference_real(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The slow reader: stored rows [T, H, D] x their scales (any format)."""
    real = values.to(torch.float32)
    if scale is None:
        return real
    if scale.dim() == 0:
        return real * scale
    wide = torch.exp2(scale.float()) if scale.dtype == torch.int8 else scale.float()
    return real * wide.unsqueeze(-1)


def reference_store(dest: str, real: torch.Tensor, scale: torch.Tensor | None) -> tuple:
    """The slow writer: what `dest` stores for real rows [T, H, D]."""
    if dest == "fp8-dynamic":
        return fp8_kv.quantize_fp8_exponent(real)
    if dest == "fp8-static":
        assert scale is not None
        return fp8_kv.quantize_fp8_static(real, scale), scale
    if dest == "int8":
        return int8_kv.quantize_rows(real)
    return real.to(getattr(torch, dest)), None


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None or a.dim() == 0:
        return (a is None) == (b is None)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", list(FORMAT_ARGS))
def test_same_format_pages_land_as_their_bytes_and_decode_exactly_as_one_engine(
    tiny_model_dir: Path, fmt: str
) -> None:
    pair, source_pages, dest_pages = landed_pair(tiny_model_dir, fmt, fmt)
    for p_cache, d_cache in zip(pair.prefill.runner.kv_caches, pair.decode.runner.kv_caches, strict=True):  # fmt: skip
        for (p_rows, p_scale), (d_rows, d_scale) in zip(
            prompt_slots(p_cache, source_pages), prompt_slots(d_cache, dest_pages), strict=True
        ):
            assert same_bits(p_rows, d_rows) and same_bits(p_scale, d_scale)
    pair.clock.now += 1.5
    pair.run()
    want = colocated_tokens(tiny_model_dir, [PROMPT], GREEDY, **SMALL, **FORMAT_ARGS[fmt])[0]
    assert pair.tokens("r") == want
    pair.assert_all_free()


@pytest.mark.parametrize(("source", "dest"), CONVERSIONS)
def test_pages_converted_at_landing_hold_what_the_reference_stores(
    tiny_model_dir: Path, source: str, dest: str
) -> None:
    pair, source_pages, dest_pages = landed_pair(tiny_model_dir, source, dest)
    rows = LAYERS_OF_TINY * 2 * len(PROMPT) * 2  # layers x (K, V) x tokens x kv heads
    checked = 0
    for p_cache, d_cache in zip(pair.prefill.runner.kv_caches, pair.decode.runner.kv_caches, strict=True):  # fmt: skip
        for (p_rows, p_scale), (d_rows, d_scale) in zip(
            prompt_slots(p_cache, source_pages), prompt_slots(d_cache, dest_pages), strict=True
        ):
            want_rows, want_scale = reference_store(dest, reference_real(p_rows, p_scale), d_scale)
            assert same_bits(d_rows, want_rows) and same_bits(d_scale, want_scale)
            checked += p_rows.shape[0] * p_rows.shape[1]
    assert checked == rows
    pair.clock.now += 1.5
    pair.run()
    final = pair.final("r")
    assert final.finish_reason == "length" and len(pair.tokens("r")) == GREEDY.max_tokens
    pair.assert_all_free()


def test_bf16_pages_travel_as_bf16_and_fp8_as_e4m3_bytes_and_exponents(
    tiny_model_dir: Path,
) -> None:
    for source, per_row in (("bfloat16", 16 * 2), ("fp8-dynamic", 16 + 1), ("int8", 16 + 2)):
        pair = make_pair(tiny_model_dir, {**SMALL, **FORMAT_ARGS[source]},
                         {**SMALL, **FORMAT_ARGS["fp8-dynamic"]}, timeout_s=TIMEOUT_S)  # fmt: skip
        pair.submit(PROMPT, GREEDY, "r")
        pair.run()
        # 3 pages x 16 tokens x 2 layers x K,V x 2 heads x the format's bytes per row
        assert pair.d_agent.stats.counts["bytes"] == 3 * 16 * 2 * 2 * 2 * per_row
        pair.assert_all_free()
