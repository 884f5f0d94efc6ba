"""Which requests speculate this step, with how many tokens, and what it has earned.

The engine asks the speculator before scheduling every step (`propose`): each running request
that is decoding gets up to k proposed tokens in `Request.spec_token_ids`, which the scheduler
puts in its next decode chunk for the target to verify (docs/speculative.md). After the step
`observe` counts what it accepted.

k per request follows its recent acceptance and what a proposal costs. A request whose
proposals are accepted with per-token probability p emits on average
E(k) = 1 + p + ... + p**k tokens per step with k proposals; each proposal costs a verify row
(VERIFY_ROW_COST of a one-row step, more of the request's share when several requests decode)
plus the proposer's own work (`Proposer.cost_per_token`: none for prompt lookup, a draft
model's decode step for a draft). k is the one that maximises E(k) / cost(k), so a request
copying its prompt at p ~ 1 verifies --num-speculative-tokens rows while a draft model, whose
every guess costs 0.42 of a target step on top, stops earlier. p is estimated as accepted /
trials, where a step that accepted a of k proposals made a + 1 trials (a successes, then the
rejection) or a trials if all were accepted: the maximum-likelihood estimate for a run that
stops at the first rejection. Both counts decay, so k follows a request whose text changes
character (a quoted file, then prose). When k falls to 0 (no k pays for itself) the request
stops speculating and, every PROBE_INTERVAL steps, proposes one token to measure again. A
proposer that must first catch up on context it has not seen (a draft model on a new prompt)
starts only where the request's remaining tokens repay that (`_repays_catch_up`).

Speculation pauses for the whole step when more than max_batch requests decode (see
SpeculativeConfig.max_batch, densa/config.py), and when the step computes a prompt: a prefill
chunk makes the step compute-bound, so verify rows cost it their full price, and a draft
model would add its own catch-up on top (docs/speculative.md, "When it turns off").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from densa.cache.integrity import IntegrityViolation
from densa.config import SpeculativeConfig
from densa.request import Request
from densa.sched.output import SchedulerOutput
from densa.spec.proposer import Proposer, SpecInput, TargetRows

# One verify row's cost relative to a one-row decode step, measured in-process on the 2-core
# AVX-512 dev machine (densa_bench/speculative/step_split.py, Qwen2.5-Coder-1.5B Q4_K_M, int8
# KV): the forward and head of 5 / 9 rows took 1.7x / 2.5x one row's. The int8 dot kernels are
# at their peak per row there; the weights, streamed once per step, are the part rows share.
VERIFY_ROW_COST = 0.17
DECAY = 0.8  # weight of the past in the acceptance counts, per verifying step
PROBE_INTERVAL = 16  # steps a request with k = 0 waits before it proposes one token again
# A fresh request starts as if its first few proposals had all been accepted: prompt lookup and
# draft models earn their keep early in a request (a quoted file is repeated from its start).
PRIOR_TRIALS = 2.0


@dataclass
class Acceptance:
    """Decayed counts of one request's verified proposals."""

    accepted: float = PRIOR_TRIALS
    trials: float = PRIOR_TRIALS
    steps_since_probe: int = 0
    seen_len: int = 0  # the request's length when it last proposed: the proposer has seen it

    @property
    def rate(self) -> float:
        """Estimated probability that a proposal is accepted, given the ones before it were."""
        return self.accepted / self.trials if self.trials > 0 else 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        rejected = 1 if num_accepted < num_proposed else 0
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + rejected

    def num_tokens(self, most: int, cost_per_token: float) -> int:
        """k for the next step: see the module docstring."""
        return best_num_tokens(self.rate, most, cost_per_token)


def step_gain(rate: float, k: int, cost_per_token: float) -> float:
    """Expected tokens per unit of step cost with k proposals:
    (1 + rate + ... + rate**k) / (1 + cost_per_token * k)."""
    expected, reach = 1.0, 1.0
    for _ in range(k):
        reach *= rate
        expected += reach
    return expected / (1.0 + cost_per_token * k)


def best_num_tokens(rate: float, most: int, cost_per_token: float) -> int:
    """The k in 0..most with the highest step_gain; the smallest on a tie."""
    best_k, best_gain = 0, 1.0
    for k in range(1, most + 1):
        gain = step_gain(rate, k, cost_per_token)
        if gain > best_gain + 1e-12:
            best_k, best_gain = k, gain
    return best_k


def step_share(num_decoding: int) -> float:
    """One request's share of a step of `num_decoding` rows, in one-row steps: the step costs
    about 1 + VERIFY_ROW_COST * (rows - 1) of them, shared by them all."""
    return (1.0 + VERIFY_ROW_COST * (num_decoding - 1)) / num_decoding


def row_cost(num_decoding: int) -> float:
    """A verify row's cost relative to one request's share of a step of `num_decoding` rows
    (0 when nobody decodes)."""
    return VERIFY_ROW_COST / step_share(num_decoding) if num_decoding else 0.0


class Speculator:
    def __init__(
        self, proposer: Proposer, config: SpeculativeConfig, greedy_only: bool = False
    ) -> None:
        self.proposer = proposer
        self.config = config
        # --deterministic: a sampled request's draws depend on how many proposals it verified,
        # which depends on the batch (speculation pauses above max_batch): only greedy ones,
        # whose tokens verification never changes, speculate.
        self.greedy_only = greedy_only
        self._acceptance: dict[str, Acceptance] = {}
        # Lifetime totals, for /metrics: tokens proposed to and accepted by the target.
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        # steps on which it paused: the batch was too large, or a prompt was to be computed
        self.num_paused_steps = 0
        # Requests that never speculate (opted out, or a grammar): the proposer keeps no state
        # for them (an MTP layer would fold their hidden states for nothing).
        self._never: set[str] = set()

    def propose(
        self, running: Sequence[Request], max_model_len: int, prompt_queued: bool = False
    ) -> None:
        """Set spec_token_ids for every decoding request that speculates in the step about to
        be scheduled; prompt_queued: a queued request may be admitted into it (its prompt would
        share the step)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = prompt_queued or len(decoding) < len(running)
        if len(decoding) > self.config.max_batch or (decoding and prefilling):
            self.num_paused_steps += 1
            return
        inputs: list[SpecInput] = []
        targets: list[Request] = []
        cost = row_cost(len(decoding)) + self.proposer.cost_per_token
        for request in decoding:
            num_tokens = self._num_tokens(request, max_model_len, cost)
            if num_tokens > 0 and not self._repays_catch_up(request, num_tokens, cost, decoding):
                num_tokens = 0
            if num_tokens > 0:
                self._acceptance[request.request_id].seen_len = request.num_tokens
                inputs.append(SpecInput(request.request_id, request.all_token_ids, num_tokens))
                targets.append(request)
        if not inputs:
            return
        for request, item, proposed in zip(
            targets, inputs, self.proposer.propose(inputs), strict=True
        ):
            request.spec_token_ids = list(proposed[: item.num_tokens])

    def _num_tokens(self, request: Request, max_model_len: int, cost_per_token: float) -> int:
        """k for this request now: its acceptance and a proposal's cost, what it may still
        generate, the context."""
        params = request.sampling_params
        sampled = self.greedy_only and not params.is_greedy
        if not params.speculative or params.structured is not None or sampled:
            # opted out; a grammar's matcher cannot take tokens back; sampled, deterministic
            if request.request_id not in self._never:
                self._never.add(request.request_id)
                self.proposer.release(request.request_id)
            return 0
        acceptance = self._acceptance.setdefault(request.request_id, Acceptance())
        k = acceptance.num_tokens(self.config.num_tokens, cost_per_token)
        if k == 0:
            acceptance.steps_since_probe += 1
            if acceptance.steps_since_probe < PROBE_INTERVAL:
                return 0
            acceptance.steps_since_probe = 0
            k = 1
        # Every verified step emits accepted + 1 tokens: never propose past max_tokens or the
        # context (the stop rule would cut them, but their rows would be computed for nothing).
        left = params.max_tokens - request.num_output_tokens - 1
        return max(0, min(k, left, max_model_len - request.num_tokens))

    def _repays_catch_up(
        self, request: Request, k: int, cost_per_token: float, decoding: Sequence[Request]
    ) -> bool:
        """Whether what k proposals a step are expected to save over the tokens the request may
        still generate repays the proposer's catch-up on the context it has not seen (a draft
        model prefilling a new prompt, or all that came during a pause). Both in target decode
        steps: saving = remaining x (1 - cost(k) / E(k)) of the request's share of a step."""
        acceptance = self._acceptance[request.request_id]
        unseen = request.num_tokens - acceptance.seen_len
        price = self.proposer.catch_up_cost_per_token
        if price == 0.0 or unseen <= self.config.num_tokens + 1:  # a step's usual catch-up
            return True
        gain = step_gain(acceptance.rate, k, cost_per_token)
        if gain <= 1.0:
            return True  # a probe: it measures, and PROBE_INTERVAL bounds what it costs
        remaining = request.sampling_params.max_tokens - request.num_output_tokens
        saving = remaining * (1.0 - 1.0 / gain) * step_share(len(decoding))
        return saving > unseen * price

    def observe(self, step: SchedulerOutput, accepted: dict[str, list[int]]) -> None:
        """Count the step's verified proposals (requests that failed it count none)."""
        for item in step.scheduled:
            if not item.spec_token_ids or item.request_id not in accepted:
                continue
            num_accepted = len(accepted[item.request_id])
            self.num_proposed_tokens += len(item.spec_token_ids)
            self.num_accepted_tokens += num_accepted
            acceptance = self._acceptance.get(item.request_id)
            if acceptance is not None:
                acceptance.record(len(item.spec_token_ids), num_accepted)

    def observe_hidden(
        self,
        step: SchedulerOutput,
        accepted: dict[str, list[int]],
        hidden: dict[str, torch.Tensor],
    ) -> None:
        """Hand the proposer the target's hidden states of the positions the step put in its
        KV for good: a chunk's own tokens and the proposals accepted (rejected rows dropped).
        Requests it saw are tracked here, so `keep_only` releases them too."""
        for item in step.scheduled:
            rows = hidden.get(item.request_id)
            if rows is None or item.request_id in self._never:
                continue
            kept = item.token_ids + accepted.get(item.request_id, [])
            self._acceptance.setdefault(item.request_id, Acceptance())
            target_rows = TargetRows(item.start_pos, kept, rows[: len(kept)])
            self.proposer.observe_hidden(item.request_id, target_rows)

    def adopt(self, request_id: str) -> None:
        """A request whose proposer state arrived from elsewhere (a landed MTP state): tracked
        from now, so `keep_only` releases it with the others."""
        self._acceptance.setdefault(request_id, Acceptance())

    def keep_only(self, live_request_ids: Iterable[str]) -> None:
        """Release the state of every request not in live_request_ids (finished, aborted or
        preempted: a preempted request recomputes its KV, and a draft model's with it)."""
        live = set(live_request_ids)
        for request_id in [r for r in self._acceptance if r not in live]:
            self.release(request_id)
        self._never &= live

    def release(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.release(request_id)

    def take_violations(self) -> list[IntegrityViolation]:
        """Stale pages of the proposer's own KV found since the last call (each ended only its
        request's speculation)."""
        return self.proposer.take_violations()
