"""Logits to tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs,
and the verification of speculative proposals.

Every request that samples randomly draws from its own torch.Generator, so its tokens depend on its
seed and its own logits only -- not on which other requests share the batch.

Verification (docs/speculative.md): a request with k proposed tokens x_1..x_k brings k + 1 rows of
logits; row j is the distribution p_j of the token after x_1..x_j, each processed as a decode row
would be with x_1..x_j already in its output (penalties, min_tokens). Proposals are point masses,
so the rejection sampling of speculative decoding reduces to: accept x_j with probability
p_j(x_j); on the first rejection draw from p_j without x_j (renormalised) and stop; after k
acceptances draw a bonus token from p_k. Every token then has exactly the target's distribution
(greedy: accept while x_j is the argmax, then take the argmax).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams
from densa.worker.logit_processing import (
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    non_finite_rows,
    sampling_probs,
)
from densa.worker.structured import StructuredRow, StructuredSampler, apply_bitmask

RANDOM_ROWS_AT_ONCE = 8  # rows whose sampling temporaries are alive at once (_sample_random)


@dataclass(frozen=True)
class SampleRequest:
    """One row of the logits to sample from."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The tokens that would end this request (StopRule.ending_tokens): kept out below min_tokens.
    ending_token_ids: frozenset[int] = frozenset()
    # Proposed tokens to verify: the request has 1 + len(draft_token_ids) rows of logits.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft_token_ids)


@dataclass(frozen=True)
class _SavedRng:
    """The random state a sampling attempt may change, to put back if it raises."""

    seed_state: torch.Tensor
    states: dict[str, torch.Tensor]  # generators of the attempt's rows that existed before it
    skipped_draws: dict[str, int]
    known: frozenset[str]  # every generator that existed before it


@dataclass(frozen=True)
class SampleResult:
    """Per request (not per row of logits): the token sampled after any accepted proposals."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Rows whose logits held no finite value to choose from (NaN/inf from the model, or from a
    # sampling setting): row index -> why. Their token ids are meaningless; the engine fails
    # exactly those requests and nobody else.
    failed: dict[int, str] = field(default_factory=dict)
    # Requests whose grammar refused the sampled token (only on a grammar resource limit).
    errors: dict[str, str] = field(default_factory=dict)
    # Verifying requests, by index: the proposed tokens accepted (before token_ids[index]), and
    # their logprobs where asked for.
    accepted: dict[int, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


class Sampler:
    def __init__(self, default_seed: int = 0, structured: StructuredSampler | None = None) -> None:
        self._generators: dict[str, torch.Generator] = {}
        # Draws made elsewhere (a first token sampled by a prefill worker), by request: skipped
        # when the request's generator is first used, as wide as the logits then are.
        self._skipped_draws: dict[str, int] = {}
        self._seed_source = torch.Generator().manual_seed(default_seed)
        self.structured = structured  # None: the engine serves no structured outputs

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._skipped_draws.pop(request_id, None)
        if self.structured is not None:
            self.structured.forget(request_id)

    def skip_draw(self, request_id: str) -> None:
        """Advance the request's RNG past one token drawn elsewhere (its first token, sampled by
        a prefill worker), so a seeded request's next tokens are those one server would draw.
        The draw is skipped when the request next samples at random (as wide as the logits)."""
        self._skipped_draws[request_id] = self._skipped_draws.get(request_id, 0) + 1

    def sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        """logits: [N, V] float32, one row per entry of `rows`.

        All or nothing for the random state: if sampling raises, every generator is put back as
        it was, so retrying the step (engine fault confinement) draws the same tokens.
        """
        saved = self.save_rng(rows)
        try:
            return self._sample(logits, rows)
        except BaseException:
            self.restore_rng(saved)
            raise

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        if any(r.draft_token_ids for r in rows):
            return self._sample_verifying(logits, rows)
        failed = non_finite_rows(logits, "the model's logits are not finite")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if _wants_logprobs(rows) else None
        logits = self._processed(logits, rows)
        token_ids = torch.argmax(logits, dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_random(logits, random_rows, rows)
        no_choice = non_finite_rows(logits, "no token is left to sample after penalties")
        chosen = token_ids.tolist()
        constrained = _constrained_rows(rows)
        errors = self._structured().accept(constrained, chosen) if constrained else {}
        logprobs = _logprobs(raw_logprobs, rows, chosen)
        return SampleResult(chosen, logprobs, no_choice | failed, errors)

    def _processed(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        """Penalties, logit bias, the grammar's mask and min_tokens, row by row."""
        logits = apply_logit_bias(apply_penalties(logits, rows), rows)
        constrained = _constrained_rows(rows)
        if constrained:
            logits = self._apply_grammar(logits, constrained)
        return apply_min_tokens(logits, rows)

    def _sample_verifying(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        """A step in which some requests verify proposals: logits has num_rows rows per request.
        Requests without proposals get exactly the tokens `_sample` would give them."""
        if any(r.draft_token_ids and r.params.structured is not None for r in rows):
            raise ValueError("a constrained request cannot verify proposals")
        starts = [0]
        for row in rows:
            starts.append(starts[-1] + row.num_rows)
        last_rows = torch.tensor(starts[1:]) - 1
        plain = [i for i, r in enumerate(rows) if not r.draft_token_ids]
        last_plain = {starts[i] for i in plain}  # their one row each
        # The plain requests' rows (their last is their only one), sampled as in any step.
        result = self._sample(logits[last_rows[plain]], [rows[i] for i in plain]) if plain else None
        expanded = [one for row in rows for one in _rows_of(row)]
        failed_rows = non_finite_rows(logits, "the model's logits are not finite")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if _wants_logprobs(rows) else None
        processed = self._processed(logits, expanded)
        no_choice_rows = non_finite_rows(processed, "no token is left to sample after penalties")
        # What the random verifying rows draw from, in one pass (one softmax for the step).
        random_rows = [
            r for r, one in enumerate(expanded) if not one.params.is_greedy and r not in last_plain
        ]
        probs = None  # greedy verification reads the logits alone
        if random_rows:
            probs = torch.zeros_like(processed)
            probs[random_rows] = sampling_probs(
                processed[random_rows], [expanded[r] for r in random_rows]
            )
        token_ids = [0] * len(rows)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        failed: dict[int, str] = {}
        accepted: dict[int, list[int]] = {}
        accepted_logprobs: dict[int, list[TokenLogprobs]] = {}
        errors: dict[str, str] = {}
        if result is not None:
            errors = result.errors
            for idx, i in enumerate(plain):
                token_ids[i], logprobs[i] = result.token_ids[idx], result.logprobs[idx]
                if idx in result.failed:
                    failed[i] = result.failed[idx]
        for i, row in enumerate(rows):
            if not row.draft_token_ids:
                continue
            span = range(starts[i], starts[i + 1])
            bad = [failed_rows.get(r) or no_choice_rows.get(r) for r in span]
            if any(bad):
                failed[i] = next(reason for reason in bad if reason)
                continue
            span_rows = slice(starts[i], starts[i + 1])
            row_probs = None if probs is None else probs[span_rows]
            kept, token_ids[i] = self._verify(processed[span_rows], row_probs, row)
            accepted[i] = kept
            chosen = [*kept, token_ids[i]]
            row_logprobs = _logprobs(
                None if raw_logprobs is None else raw_logprobs[starts[i] : starts[i] + len(chosen)],
                [row] * len(chosen),
                chosen,
            )
            logprobs[i] = row_logprobs[-1]
            if row.params.logprobs is not None:
                accepted_logprobs[i] = [lp for lp in row_logprobs[:-1] if lp is not None]
        return SampleResult(token_ids, logprobs, failed, errors, accepted, accepted_logprobs)

    def _verify(
        self, logits: torch.Tensor, probs: torch.Tensor | None, row: SampleRequest
    ) -> tuple[list[int], int]:
        """logits: [1 + k, V] processed rows of one request with k proposals, probs: what its
        random rows draw from (sampling_probs of them; None for a greedy request) -> (the
        accepted proposals, the token after them): see the module docstring."""
        drafts = list(row.draft_token_ids)
        if row.params.is_greedy:
            best = torch.argmax(logits, dim=-1).tolist()
            num_accepted = 0
            while num_accepted < len(drafts) and best[num_accepted] == drafts[num_accepted]:
                num_accepted += 1
            return drafts[:num_accepted], best[num_accepted]
        assert probs is not None, "a random row has the probabilities it draws from"
        generator = self._generator(row, probs.shape[-1])
        for j, draft in enumerate(drafts):
            p = probs[j]
            u = float(torch.rand((), generator=generator))
            if u * float(p.sum()) < float(p[draft]):
                continue
            residual = p.clone()
            residual[draft] = 0.0  # p without the rejected proposal, renormalised by the race
            return drafts[:j], _race(residual, generator)
        return drafts, _race(probs[len(drafts)], generator)

    def save_rng(self, rows: list[SampleRequest]) -> _SavedRng:
        """The random state sampling `rows` may change (`restore_rng` puts it back)."""
        states = {
            r.request_id: self._generators[r.request_id].get_state()
            for r in rows
            if not r.params.is_greedy and r.request_id in self._generators
        }
        known = frozenset(self._generators)
        return _SavedRng(self._seed_source.get_state(), states, dict(self._skipped_draws), known)

    def restore_rng(self, saved: _SavedRng) -> None:
        self._seed_source.set_state(saved.seed_state)
        for request_id in list(self._generators):
            if request_id not in saved.known:  # made in the failed attempt: made again, the same
                del self._generators[request_id]
            elif request_id in saved.states:
                self._generators[request_id].set_state(saved.states[request_id])
        self._skipped_draws = saved.skipped_draws

    def _apply_grammar(
        self, logits: torch.Tensor, constrained: list[StructuredRow]
    ) -> torch.Tensor:
        structured = self._structured()
        start = time.perf_counter()
        bitmask = structured.fill_bitmask(constrained, logits.shape[0])
        filled = time.perf_counter()
        logits = apply_bitmask(logits, bitmask, [c.row for c in constrained])
        times = structured.times
        times.fill_s += filled - start
        times.apply_s += time.perf_counter() - filled
        times.num_masks += len(constrained)
        times.num_steps += 1
        return logits

    def _structured(self) -> StructuredSampler:
        if self.structured is None:
            raise RuntimeError(
                "a structured output reached an engine built without a grammar compiler"
            )
        return self.structured

    def _sample_random(
        self, logits: torch.Tensor, row_idx: list[int], rows: list[SampleRequest]
    ) -> torch.Tensor:
        """Draws for the rows `row_idx` of logits, RANDOM_ROWS_AT_ONCE rows at a time: each
        row's token depends on its own logits and generator only, and the temporaries (scaled
        logits, probabilities, noise: ~0.6 MB each per row of a 150k vocabulary) stay a few
        rows wide instead of ~150 MB at 64 rows."""
        tokens = []
        for start in range(0, len(row_idx), RANDOM_ROWS_AT_ONCE):
            idx = row_idx[start : start + RANDOM_ROWS_AT_ONCE]
            chunk = [rows[i] for i in idx]
            probs = sampling_probs(logits[idx], chunk)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; a row uses its own RNG.
            noise = torch.empty_like(probs)
            for i, row in enumerate(chunk):
                noise[i].exponential_(generator=self._generator(row, probs.shape[-1]))
            tokens.append(torch.argmax(probs.div_(noise), dim=-1))
        return torch.cat(tokens)

    def _generator(self, row: SampleRequest, vocab_size: int) -> torch.Generator:
        generator = self._generators.get(row.request_id)
        if generator is None:
            seed = row.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            generator = torch.Generator().manual_seed(seed)
            self._generators[row.request_id] = generator
        for _ in range(self._skipped_draws.pop(row.request_id, 0)):
            torch.empty(vocab_size).exponential_(generator=generator)
        return generator


def _race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs ([V], any scale) by the exponential race, from `generator`."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def _rows_of(row: SampleRequest) -> list[SampleRequest]:
    """One SampleRequest per logits row of a verifying request: row j sees the first j
    proposals as output already (penalties, min_tokens), as a decode row after them would."""
    drafts = list(row.draft_token_ids)
    return [
        replace(row, output_token_ids=[*row.output_token_ids, *drafts[:j]], draft_token_ids=())
        for j in range(row.num_rows)
    ]


def _constrained_rows(rows: list[SampleRequest]) -> list[StructuredRow]:
    return [
        StructuredRow(i, r.request_id, r.params.structured, r.output_token_ids)
        for i, r in enumerate(rows)
        if r.params.structured is not None
    ]


def _wants_logprobs(rows: list[SampleRequest]) -> bool:
    return any(r.params.logprobs is not None for r in rows)


def _logprobs(
    raw: torch.Tensor | None, rows: list[SampleRequest], chosen: list[int]
) -> list[TokenLogprobs | None]:
    if raw is None:
        return [None] * len(rows)
    results: list[TokenLogprobs | None] = []
    for i, row in enumerate(rows):
        num_top = row.params.logprobs
        if num_top is None:
            results.append(None)
            continue
        top = torch.topk(raw[i], num_top) if num_top > 0 else None
        pairs = (
            list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            if top is not None
            else []
        )
        results.append(TokenLogprobs(chosen[i], float(raw[i, chosen[i]]), pairs))
    return results
