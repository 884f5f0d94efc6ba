"""Fault confinement for the forward pass: a step that raises fails only the requests that cause it.

A step runs many requests in one batch, so an exception inside the runner (preparing the batch,
the forward pass, sampling) does not say whose it is. Rather than failing everyone in flight, the
step is re-run on smaller groups until every failure is pinned on one request:

    1. the step without the requests admitted in it (the usual suspects: everyone else already
       ran fine in earlier steps), then each of those newest admissions alone;
    2. a group that still fails is split in half and each half re-run (bisection);
    3. a request that fails alone is confirmed as the cause and ends with an error; every other
       request keeps the result of the group it succeeded in.

Re-running is safe because the step's deltas (new requests, pages, tags) are taken in once,
before the first attempt, and the computation is idempotent up to its results: it writes K/V
only into slots of the positions it computes (re-running writes the same values into the same
slots), and the sampler restores every random generator when it raises, so a seeded request
draws the same tokens on the retry. Cost: nothing while steps succeed; after a
fault, O(k log n) extra runs of small groups for k faulty requests among n.
"""

from __future__ import annotations

from collections.abc import Callable

from densa.sched.mirror import ScheduledRequest
from densa.utils.logging import get_logger
from densa.worker.step_output import RunnerOutput

logger = get_logger(__name__)

ERROR_MESSAGE = (
    "engine_error: this request failed a step on its own ({kind}); it was ended alone and no "
    "other request was affected (the server log has the details)"
)
Compute = Callable[[list[ScheduledRequest]], RunnerOutput]


def compute_confined(
    compute: Compute, items: list[ScheduledRequest], newest: set[str]
) -> RunnerOutput:
    """Compute the step's requests; if that raises, find the request(s) responsible and fail
    only those (their ids are in `RunnerOutput.errors`). The step's deltas were taken in once,
    before (ModelRunner.begin); only the computation is re-run. `newest`: the requests admitted
    in this step, the first suspects."""
    try:
        return compute(items)
    except Exception:
        ids = [s.request_id for s in items]
        logger.exception("a step of %d requests failed; isolating the cause: %s", len(ids), ids)
        return _isolate(compute, items, newest)


def _isolate(compute: Compute, items: list[ScheduledRequest], newest: set[str]) -> RunnerOutput:
    suspects = [s for s in items if s.request_id in newest]
    others = [s for s in items if s.request_id not in newest]
    pending: list[list[ScheduledRequest]] = [others] if others else []
    pending += [[s] for s in suspects]
    merged = RunnerOutput()
    while pending:
        group = pending.pop(0)
        try:
            _merge(merged, compute(group))
        except Exception as exc:
            if len(group) > 1:
                half = len(group) // 2
                pending[:0] = [group[:half], group[half:]]
                continue
            request_id = group[0].request_id
            logger.exception("request %s fails a step alone: ending it", request_id)
            merged.errors[request_id] = ERROR_MESSAGE.format(kind=type(exc).__name__)
    return merged


def _merge(into: RunnerOutput, part: RunnerOutput) -> None:
    into.sampled_token_ids.update(part.sampled_token_ids)
    into.accepted_token_ids.update(part.accepted_token_ids)
    into.accepted_logprobs.update(part.accepted_logprobs)
    into.hidden.update(part.hidden)
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)
    into.failed.update(part.failed)
    into.errors.update(part.errors)
