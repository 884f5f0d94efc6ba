"""The delta rule's decode step (Gated DeltaNet, KDA): densa's C++ kernel on both code paths and
its torch fallback against the per-(request, head) torch reference, at Qwen3-Next's decode shape
and at odd tiny shapes (the vector and scalar tails), with both decay shapes; in place on the
slots named, bit-for-bit nothing else; bitwise deterministic; T tokens in one call the same bits
as T calls."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from densa.kernels.cpu import delta_rule, native
from densa.kernels.reference.delta_rule import (
    delta_rule_decode_reference,
    delta_rule_decode_steps_reference,
    delta_rule_step_reference,
)
from tests.kernels.test_gil_release import _assert_releases_the_gil

needs_native = pytest.mark.skipif(not native.is_available(), reason="C++ kernels not built")
NUM_SLOTS = 11
# (H, Dk, Dv): Qwen3-Next's value heads, then tails: Dv 40 = a 32-column block + 8 (one AVX2
# vector, AVX-512's scalar tail), 53 = a block + a vector + 5 scalar columns, 3 x 5 all scalar.
SHAPES = [(32, 128, 128), (2, 16, 40), (3, 7, 53), (2, 3, 5)]
SHAPE_IDS = ["qwen3next-h32-128", "h2-16x40", "h3-7x53", "h2-3x5"]
PATHS = ["avx512_vnni", "avx2"]


def _skip_unless_runs(isa: str) -> None:
    ext = native.load()
    if isa == "avx512_vnni" and (ext is None or ext.best_isa() != isa):
        pytest.skip("this CPU has no AVX-512 VNNI")


@dataclass
class Case:
    """A state pool and one call's inputs (T tokens per request), as the model passes them:
    q and k l2-normalized, q scaled by Dk^-0.5, decays in (0, 1), beta in (0, 1)."""

    pool: torch.Tensor
    slot_ids: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_decay: torch.Tensor
    beta: torch.Tensor

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.log_decay, self.beta

    def first_token(self) -> tuple[torch.Tensor, ...]:
        return tuple(x[:, 0] for x in self.inputs())


def make_case(
    batch: int, shape: tuple[int, int, int], per_channel: bool, num_tokens: int = 1, seed: int = 0
) -> Case:
    heads, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen)

    q = torch.nn.functional.normalize(rand(batch, num_tokens, heads, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(rand(batch, num_tokens, heads, dk), dim=-1)
    decay_shape = (batch, num_tokens, heads, dk) if per_channel else (batch, num_tokens, heads)
    log_decay = -torch.rand(decay_shape, generator=gen) * 2
    beta = torch.rand(batch, num_tokens, heads, generator=gen)
    slot_ids = torch.randperm(NUM_SLOTS, generator=gen)[:batch]
    pool = rand(NUM_SLOTS, heads, dk, dv)
    return Case(pool, slot_ids, q, k, rand(batch, num_tokens, heads, dv), log_decay, beta)


def _assert_only_slots_changed(
    before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor
) -> None:
    others = [s for s in range(before.shape[0]) if s not in slots.tolist()]
    assert torch.equal(after[others], before[others])
    assert not torch.equal(after[slots], before[slots])


@needs_native
@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("batch", [1, 8])
def test_native_step_matches_reference(
    forced_isa: str, shape: tuple[int, int, int], per_channel: bool, batch: int
) -> None:
    _skip_unless_runs(forced_isa)
    case = make_case(batch, shape, per_channel)
    expected_pool = case.pool.clone()
    expected = delta_rule_decode_reference(expected_pool, case.slot_ids, *case.first_token())
    before = case.pool.clone()
    out = delta_rule.delta_rule_decode(case.pool, case.slot_ids, *case.first_token())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.pool, expected_pool, rtol=1e-5, atol=1e-5)
    _assert_only_slots_changed(before, case.pool, case.slot_ids)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=SHAPE_IDS[1:])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_torch_fallback_matches_reference(shape: tuple[int, int, int], per_channel: bool) -> None:
    case = make_case(3, shape, per_channel, num_tokens=2)
    expected_pool = case.pool.clone()
    expected = delta_rule_decode_steps_reference(expected_pool, case.slot_ids, *case.inputs())
    before = case.pool.clone()
    out = delta_rule.torch_delta_rule_steps(case.pool, case.slot_ids, *case.inputs())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.pool, expected_pool, rtol=1e-5, atol=1e-5)
    _assert_only_slots_changed(before, case.pool, case.slot_ids)


@needs_native
@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_steps_match_reference_and_equal_one_call_per_token(
    forced_isa: str, per_channel: bool
) -> None:
    _skip_unless_runs(forced_isa)
    case = make_case(4, (3, 7, 53), per_channel, num_tokens=5)
    expected_pool = case.pool.clone()
    expected = delta_rule_decode_steps_reference(expected_pool, case.slot_ids, *case.inputs())
    stepped_pool = case.pool.clone()
    out = delta_rule.delta_rule_decode_steps(case.pool, case.slot_ids, *case.inputs())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.pool, expected_pool, rtol=1e-5, atol=1e-5)
    for t in range(5):
        token = (x[:, t] for x in case.inputs())
        one = delta_rule.delta_rule_decode(stepped_pool, case.slot_ids, *token)
        assert torch.equal(one, out[:, t])
    assert torch.equal(stepped_pool, case.pool)


@needs_native
@pytest.mark.parametrize("forced_isa", PATHS, indirect=True)
def test_bitwise_deterministic_across_runs_and_thread_counts(forced_isa: str) -> None:
    _skip_unless_runs(forced_isa)
    case = make_case(8, SHAPES[0], per_channel=True)
    results = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (threads, threads, 1):
            torch.set_num_threads(num_threads)
            pool = case.pool.clone()
            results.append(
                (delta_rule.delta_rule_decode(pool, case.slot_ids, *case.first_token()), pool)
            )
    finally:
        torch.set_num_threads(threads)
    for out, pool in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(pool, results[0][1])


def test_grouped_value_heads_take_repeated_q_and_k() -> None:
    """GDN's 16 key heads / 32 value heads: the caller repeats q and k per value head group; the
    kernel then equals the reference that reads q/k head h // 2 for value head h."""
    num_k_heads, num_v_heads, dk, dv = 16, 32, 128, 128
    case = make_case(2, (num_k_heads, dk, dv), per_channel=False)
    group = num_v_heads // num_k_heads
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(2, num_v_heads, dv, generator=gen)
    log_decay = -torch.rand(2, num_v_heads, generator=gen)
    beta = torch.rand(2, num_v_heads, generator=gen)
    pool = torch.randn(NUM_SLOTS, num_v_heads, dk, dv, generator=gen)
    q, k = case.q[:, 0], case.k[:, 0]  # [B, Hk, Dk]
    expected_pool = pool.clone()
    out = delta_rule.delta_rule_decode(
        pool, case.slot_ids, q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1),
        v, log_decay, beta,
    )  # fmt: skip
    for b, slot in enumerate(case.slot_ids.tolist()):
        for h in range(num_v_heads):
            o, s = delta_rule_step_reference(
                expected_pool[slot, h], q[b, h // group], k[b, h // group], v[b, h],
                log_decay[b, h], beta[b, h],
            )  # fmt: skip
            torch.testing.assert_close(out[b, h], o, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(pool[slot, h], s, rtol=1e-5, atol=1e-5)


@needs_native
def test_bfloat16_inputs_are_widened() -> None:
    case = make_case(2, (2, 16, 40), per_channel=True)
    bf16 = [x[:, 0].bfloat16() for x in case.inputs()]
    widened_pool = case.pool.clone()
    expected = delta_rule.delta_rule_decode(widened_pool, case.slot_ids, *(x.float() for x in bf16))
    out = delta_rule.delta_rule_decode(case.pool, case.slot_ids, *bf16)
    assert torch.equal(out, expected) and torch.equal(case.pool, widened_pool)


@needs_native
def test_a_slot_strided_pool_is_updated_in_place() -> None:
    """A pool that is one layer of a [slots, layers, H, Dk, Dv] tensor: each slot contiguous, the
    slot stride larger; the kernel writes through the view, other layers untouched."""
    case = make_case(3, (2, 16, 40), per_channel=False)
    layers = torch.randn(NUM_SLOTS, 3, 2, 16, 40)
    layers[:, 1] = case.pool
    before = layers.clone()
    expected = delta_rule_decode_reference(case.pool, case.slot_ids, *case.first_token())
    out = delta_rule.delta_rule_decode(layers[:, 1], case.slot_ids, *case.first_token())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layers[:, 1], case.pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(layers[:, [0, 2]], before[:, [0, 2]])


@needs_native
@pytest.mark.parametrize(
    ("slot_ids", "message"), [([2, 2], "appears twice"), ([1, NUM_SLOTS], "out of range")]
)
def test_bad_slot_ids_are_refused(slot_ids: list[int], message: str) -> None:
    case = make_case(2, (2, 3, 5), per_channel=False)
    with pytest.raises(RuntimeError, match=message):
        delta_rule.delta_rule_decode(case.pool, torch.tensor(slot_ids), *case.first_token())


@needs_native
def test_the_kernel_releases_the_gil() -> None:
    case = make_case(8, SHAPES[0], per_channel=False)

    def make(num_tokens: int):  # type: ignore[no-untyped-def]
        steps = [x.expand(-1, num_tokens, *x.shape[2:]).contiguous() for x in case.inputs()]
        return lambda: delta_rule.delta_rule_decode_steps(case.pool, case.slot_ids, *steps)

    _assert_releases_the_gil(make, max_n=4096)
