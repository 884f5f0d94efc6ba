"""Sampling semantics on hand-made logits: filters, seeds, penalties, logprobs."""

from __future__ import annotations

import contextlib
import math

import torch

from densa.sampling_params import SamplingParams
from densa.sched.stop import StopRule
from densa.worker.logit_processing import non_finite_rows
from densa.worker.sampler import RANDOM_ROWS_AT_ONCE, Sampler, SampleRequest

EOS = 3
STOP_RULE = StopRule(eos_token_ids=(EOS,), max_model_len=1024)


def row(
    rid: str, prompt: list[int] | None = None, output: list[int] | None = None, **params: object
) -> SampleRequest:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    ending = STOP_RULE.ending_tokens(sampling)
    return SampleRequest(rid, sampling, prompt or [], output or [], ending)


def draw(params: dict[str, object], logits: list[float], num: int, seed: int = 0) -> list[int]:
    """`num` samples from one request (its own generator), one token per step."""
    sampler = Sampler()
    tensor = torch.tensor([logits])
    return [
        sampler.sample(tensor, [row("r", seed=seed, **params)]).token_ids[0] for _ in range(num)
    ]


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    result = Sampler().sample(logits, [row("a", temperature=0.0), row("b", temperature=0.0)])
    assert result.token_ids == [1, 0]


def test_temperature_one_follows_the_distribution() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    samples = draw({"temperature": 1.0}, [math.log(p) for p in probs], 4000)
    freqs = [samples.count(i) / len(samples) for i in range(4)]
    for freq, prob in zip(freqs, probs, strict=True):
        assert abs(freq - prob) < 0.03, (freqs, probs)


def test_top_k_top_p_min_p_exclude_the_tail() -> None:
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert set(draw({"top_k": 2}, logits, 300)) == {0, 1}
    assert set(draw({"top_p": 0.65}, logits, 300)) == {0, 1}  # 0.4 < 0.65 -> keep the next too
    assert set(draw({"top_p": 0.3}, logits, 100)) == {0}  # the top token is always kept
    assert set(draw({"min_p": 0.6}, logits, 300)) == {0, 1}  # keep p >= 0.6 * 0.4
    assert set(draw({"top_k": 1}, logits, 50)) == {0}


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone = Sampler()
    solo = [alone.sample(logits[1:2], [row("x", seed=42)]).token_ids[0] for _ in range(20)]
    batched = Sampler()
    rows = [row("a", seed=1), row("x", seed=42), row("c")]
    together = [batched.sample(logits, rows).token_ids[1] for _ in range(20)]
    assert solo == together
    assert len(set(solo)) > 1  # really random, not constant


def test_repetition_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    sampler = Sampler()
    greedy = {"temperature": 0.0}
    # Token 0 seen in the prompt: 2.0 / 2.5 = 0.8 < 1.0 -> token 2 wins.
    assert sampler.sample(
        logits, [row("r", prompt=[0], repetition_penalty=2.5, **greedy)]
    ).token_ids == [2]
    # Output [0, 0]: frequency 0.6 * 2 = 1.2 -> 0.8 < 1.0 -> token 2 wins.
    assert sampler.sample(
        logits, [row("f", output=[0, 0], frequency_penalty=0.6, **greedy)]
    ).token_ids == [2]
    # Presence is flat: 2.0 - 0.9 = 1.1 > 1.0 -> token 0 still wins.
    assert sampler.sample(
        logits, [row("p", output=[0, 0], presence_penalty=0.9, **greedy)]
    ).token_ids == [0]


def test_logit_bias_adds_to_the_named_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    sampler = Sampler()
    rows = [
        row("ban", logit_bias={0: -100.0}, temperature=0.0),  # token 0 banned: token 2 wins
        row("lift", logit_bias={1: 4.5, 99: 100.0}, temperature=0.0),  # 99: past this vocab
    ]
    assert sampler.sample(logits, rows).token_ids == [2, 1]
    seeded = [row("s", logit_bias={3: 100.0}, seed=7)]
    assert {sampler.sample(logits[:1], seeded).token_ids[0] for _ in range(20)} == {3}


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    sampler = Sampler()
    blocked = row("m", output=[], min_tokens=2, stop_token_ids=[2], temperature=0.0)
    assert sampler.sample(logits, [blocked]).token_ids == [0]
    allowed = row("n", output=[9, 9], min_tokens=2, temperature=0.0)
    assert sampler.sample(logits, [allowed]).token_ids == [EOS]


def test_logprobs_are_the_models_log_softmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    result = Sampler().sample(logits, [row("l", temperature=0.0, logprobs=2)])
    expected = torch.log_softmax(logits[0], -1)
    entry = result.logprobs[0]
    assert entry is not None and entry.token_id == 1
    assert math.isclose(entry.logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in entry.top] == [1, 2]
    assert math.isclose(entry.top[1][1], float(expected[2]), rel_tol=1e-6)


def test_top_p_keeps_the_most_likely_tokens_whatever_their_order() -> None:
    """Shuffled logits: the kept set is defined by probability, not by position (a mask left in
    sorted order would keep the *least* likely tokens here)."""
    probs = {7: 0.45, 2: 0.3, 5: 0.15, 0: 0.06, 3: 0.04}  # token id -> probability
    logits = [float("-inf")] * 8
    for token, prob in probs.items():
        logits[token] = math.log(prob)
    assert set(draw({"top_p": 0.7}, logits, 400)) == {7, 2}
    assert set(draw({"top_p": 0.8}, logits, 400)) == {7, 2, 5}
    many = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    sampler = Sampler()
    for _ in range(30):
        rows = [row(f"r{i}", top_p=0.5, seed=i) for i in range(4)]
        chosen = sampler.sample(many, rows).token_ids
        for i, token in enumerate(chosen):
            ordered = torch.softmax(many[i], -1).sort(descending=True)
            cutoff = int((ordered.values.cumsum(0) - ordered.values < 0.5).sum())
            assert token in ordered.indices[:cutoff].tolist()


def test_a_wide_batch_draws_what_each_row_draws_alone() -> None:
    """Random rows are sampled RANDOM_ROWS_AT_ONCE at a time (memory): with greedy rows in
    between and top-k / top-p / min-p differing by row, each seeded row still draws exactly
    what it draws alone, step after step."""
    num_rows = 3 * RANDOM_ROWS_AT_ONCE + 2
    logits = torch.randn(num_rows, 300, generator=torch.Generator().manual_seed(2))
    settings = [{"temperature": 0.0}, {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}, {}]
    rows = [row(f"r{i}", seed=i, **settings[i % len(settings)]) for i in range(num_rows)]
    batched = Sampler()
    together = [batched.sample(logits, rows).token_ids for _ in range(3)]
    for i, one in enumerate(rows):
        alone = Sampler()
        solo = [alone.sample(logits[i : i + 1], [one]).token_ids[0] for _ in range(3)]
        assert solo == [step[i] for step in together], i


def test_extreme_settings_sample_sanely_never_nan() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    assert set(draw({"temperature": 1e-45}, logits[0].tolist(), 20)) == {1}  # greedy in the limit
    assert set(draw({"top_p": 1e-300}, logits[0].tolist(), 20)) == {1}  # underflows: top-1 kept
    assert set(draw({"top_p": 1e-300, "temperature": 2.0}, logits[0].tolist(), 20)) == {1}
    result = Sampler().sample(logits, [row("r", prompt=[1, 2], repetition_penalty=0.01)])
    assert not result.failed and 0 <= result.token_ids[0] < 4


def test_rows_without_a_finite_logit_fail_alone() -> None:
    logits = torch.tensor(
        [[1.0, float("nan"), 0.0], [0.0, 2.0, 1.0], [float("inf"), 0.0, 0.0], [float("-inf")] * 3]
    )
    result = Sampler().sample(logits, [row(f"r{i}", temperature=0.0) for i in range(4)])
    assert set(result.failed) == {0, 2, 3}
    assert result.token_ids[1] == 1


def test_non_finite_rows_of_a_vocabulary_width() -> None:
    """One amax per row finds what four elementwise passes found, at any position of a row as
    wide as a real vocabulary (the vectorised reduction's lanes and its scalar tail)."""
    vocab = 151_936
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3))
    logits[0, 0] = float("nan")
    logits[1, vocab - 1] = float("nan")  # in the tail past the last full vector
    logits[2, 77_777] = float("inf")
    logits[3] = float("-inf")
    logits[4, ::2] = float("-inf")  # masked tokens alone are normal
    logits[5, 5] = float("-inf")
    logits[5, 6] = float("nan")  # a NaN beside -inf still counts
    logits[6, 1000:] = float("-inf")
    logits[6, 12] = float("-inf")
    assert non_finite_rows(logits, "bad") == {0: "bad", 1: "bad", 2: "bad", 3: "bad", 5: "bad"}


def test_a_failed_sample_leaves_every_generator_where_it_was() -> None:
    """Fault confinement re-runs a failed step: seeded rows must draw the same tokens again."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(5))
    rows = [row("a", seed=1, temperature=1.0), row("b", temperature=1.0)]
    sampler = Sampler()
    sampler.sample(logits, rows)  # both generators exist now
    expected = Sampler()
    expected.sample(logits, rows)
    reference = expected.sample(logits, rows).token_ids[0]

    original = torch.Tensor.exponential_
    calls = iter(range(100))

    def failing(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if next(calls) == 1:  # after row "a" drew its noise
            raise RuntimeError("injected")
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    torch.Tensor.exponential_ = failing  # type: ignore[method-assign]
    try:
        with contextlib.suppress(RuntimeError):
            sampler.sample(logits, rows)
    finally:
        torch.Tensor.exponential_ = original  # type: ignore[method-assign]
    assert sampler.sample(logits, rows).token_ids[0] == reference


def test_a_draw_made_elsewhere_is_skipped_so_seeded_tokens_continue_as_on_one_sampler() -> None:
    """A prefill worker drew a seeded request's first token; the decode worker's sampler skips
    that draw, so its tokens from the second on are the ones one sampler would draw."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    one = Sampler()
    tokens = [
        one.sample(logits, [row("r", seed=11, temperature=1.0)]).token_ids[0] for _ in range(4)
    ]
    decode = Sampler()
    decode.skip_draw("r")
    rest = [
        decode.sample(logits, [row("r", seed=11, temperature=1.0)]).token_ids[0] for _ in range(3)
    ]
    assert rest == tokens[1:]


def test_a_skipped_draw_survives_a_failed_sample() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    want = Sampler()
    want.skip_draw("r")
    expected = want.sample(logits, [row("r", seed=11, temperature=1.0)]).token_ids[0]
    sampler = Sampler()
    sampler.skip_draw("r")
    original = torch.Tensor.exponential_

    def failing(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        original(self, *args, **kwargs)  # type: ignore[arg-type]  # the skipped draw happens...
        raise RuntimeError("injected")  # ...then the attempt fails

    torch.Tensor.exponential_ = failing  # type: ignore[method-assign]
    try:
        with contextlib.suppress(RuntimeError):
            sampler.sample(logits, [row("r", seed=11, temperature=1.0)])
    finally:
        torch.Tensor.exponential_ = original  # type: ignore[method-assign]
    assert sampler.sample(logits, [row("r", seed=11, temperature=1.0)]).token_ids[0] == expected
