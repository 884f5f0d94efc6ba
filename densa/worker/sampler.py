"""Logits to tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Every request that samples randomly draws from its own torch.Generator, so its tokens depend on its
seed and its own logits only -- not on which other requests share the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams
from densa.worker.structured import StructuredRow, StructuredSampler, apply_bitmask


@dataclass(frozen=True)
class SampleRequest:
    """One row of the logits to sample from."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The tokens that would end this request (StopRule.ending_tokens): kept out below min_tokens.
    ending_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class _SavedRng:
    """The random state a sampling attempt may change, to put back if it raises."""

    seed_state: torch.Tensor
    states: dict[str, torch.Tensor]  # generators of the attempt's rows that existed before it
    skipped_draws: dict[str, int]
    known: frozenset[str]  # every generator that existed before it


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Rows whose logits held no finite value to choose from (NaN/inf from the model, or from a
    # sampling setting): row index -> why. Their token ids are meaningless; the engine fails
    # exactly those requests and nobody else.
    failed: dict[int, str] = field(default_factory=dict)
    # Requests whose grammar refused the sampled token (only on a grammar resource limit).
    errors: dict[str, str] = field(default_factory=dict)


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
        saved = self._save_rng(rows)
        try:
            return self._sample(logits, rows)
        except BaseException:
            self._restore_rng(saved)
            raise

    def _sample(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SampleResult:
        failed = _non_finite_rows(logits, "the model's logits are not finite")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if _wants_logprobs(rows) else None
        logits = _apply_logit_bias(_apply_penalties(logits, rows), rows)
        constrained = _constrained_rows(rows)
        if constrained:
            logits = self._apply_grammar(logits, constrained)
        logits = _apply_min_tokens(logits, rows)
        token_ids = torch.argmax(logits, dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_random(
                logits[random_rows], [rows[i] for i in random_rows]
            )
        no_choice = _non_finite_rows(logits, "no token is left to sample after penalties")
        chosen = token_ids.tolist()
        errors = self._structured().accept(constrained, chosen) if constrained else {}
        logprobs = _logprobs(raw_logprobs, rows, chosen)
        return SampleResult(chosen, logprobs, no_choice | failed, errors)

    def _save_rng(self, rows: list[SampleRequest]) -> _SavedRng:
        states = {
            r.request_id: self._generators[r.request_id].get_state()
            for r in rows
            if not r.params.is_greedy and r.request_id in self._generators
        }
        known = frozenset(self._generators)
        return _SavedRng(self._seed_source.get_state(), states, dict(self._skipped_draws), known)

    def _restore_rng(self, saved: _SavedRng) -> None:
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

    def _sample_random(self, logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
        temperatures = torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
        logits = _filter_top_k(logits / temperatures, rows)
        logits = _filter_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        probs = _filter_min_p(probs, rows)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each row uses its own RNG.
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=self._generator(row, probs.shape[-1]))
        return torch.argmax(probs / noise, dim=-1)

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


def _non_finite_rows(logits: torch.Tensor, reason: str) -> dict[int, str]:
    """Rows with a NaN or +inf (softmax turns either into NaN), or with no finite logit at all
    (nothing to choose from). -inf alone is normal: it is how tokens are masked."""
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
    bad |= ~torch.isfinite(logits).any(dim=-1)
    if not bool(bad.any()):  # the common case: one reduction, one check
        return {}
    return {int(i): reason for i in bad.nonzero().flatten().tolist()}


def _constrained_rows(rows: list[SampleRequest]) -> list[StructuredRow]:
    return [
        StructuredRow(i, r.request_id, r.params.structured, r.output_token_ids)
        for i, r in enumerate(rows)
        if r.params.structured is not None
    ]


def _wants_logprobs(rows: list[SampleRequest]) -> bool:
    return any(r.params.logprobs is not None for r in rows)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not penalized:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in penalized:
        params = rows[i].params
        output_counts = torch.bincount(
            torch.tensor(rows[i].output_token_ids, dtype=torch.long), minlength=vocab
        )
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = output_counts > 0
            seen[torch.tensor(rows[i].prompt_token_ids, dtype=torch.long)] = True
            # CTRL-style: shrink positive logits, grow negative ones, for every token already seen.
            penalized_row = torch.where(
                row > 0, row / params.repetition_penalty, row * params.repetition_penalty
            )
            row = torch.where(seen[:vocab], penalized_row, row)
        row = row - params.frequency_penalty * output_counts[:vocab].to(row.dtype)
        row = row - params.presence_penalty * (output_counts[:vocab] > 0).to(row.dtype)
        logits[i] = row
    return logits


def _apply_logit_bias(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    for i in biased:
        pairs = [(t, b) for t, b in rows[i].params.logit_bias if t < logits.shape[1]]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
        logits[i] = logits[i].index_add(0, ids, bias)
    return logits


def _apply_min_tokens(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    blocked = [(i, r) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens]
    if not blocked:
        return logits
    logits = logits.clone()
    for i, r in blocked:
        ids = [t for t in r.ending_token_ids if t < logits.shape[1]]
        if not ids:
            continue
        blocked_row = logits[i].index_fill(0, torch.tensor(ids), float("-inf"))
        # A grammar that allows only EOS wins over min_tokens: a row of -inf has no token.
        if not bool(torch.isneginf(blocked_row).all()):
            logits[i] = blocked_row
    return logits


def _filter_top_k(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    if all(k == vocab for k in ks):
        return logits
    kth = torch.topk(logits, max(ks), dim=-1).values  # [N, max_k], descending
    threshold = kth.gather(1, torch.tensor(ks).unsqueeze(1) - 1)  # [N, 1]: the k-th largest
    return logits.masked_fill(logits < threshold, float("-inf"))


def _filter_top_p(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    top_p = torch.tensor([r.params.top_p for r in rows]).unsqueeze(1)
    if bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens before it already reach top_p. The most likely token is always
    # kept, even when top_p underflows float32 (1e-300 is 0 here, and 0 >= 0 would drop it).
    drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _filter_min_p(probs: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    min_p = torch.tensor([r.params.min_p for r in rows]).unsqueeze(1)
    if bool((min_p <= 0.0).all()):
        return probs
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)


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
