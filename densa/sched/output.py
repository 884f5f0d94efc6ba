"""What the scheduler hands the runner each step: plain data, in deltas.

A request's prompt and sampling parameters cross once, in a NewRequest, when it is admitted (and
again after a preemption, since the runner dropped it). After that each step carries only what
changed: the tokens this step computes and the pages mapped since the runner last saw the request.
The runner mirrors each request's page table and tokens (sched/mirror.py), so a step costs
O(new tokens + new pages) to describe, not O(context): the same contract works when the runner
lives in another process or on another host.

Device KV crosses this contract and nothing else (no module outside densa/worker holds a page
tensor), both ways:

    into pages   KVLanding   a prefill worker's pages (densa/disagg), or blocks a KV tier had
                             (engine/kv_tiers.py): written before the step reads any page
    out of pages KVExport    pages to copy out as they are before the step writes any (cached
                             pages on their way down to a KV tier, held pages a transfer sends):
                             answered in the runner's output (RunnerOutput.exported)

In the runner a step is applied in this order: tag updates, exports, landings, requests ended and
new, then the chunks are computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from densa.ipc.messages import TokenLogprobs
from densa.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen (first admission, or re-admission after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens generated before a preemption: recomputed as context, and seen by penalties.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PageGrant:
    """Entry `index` of a request's page table is `page_id`, expected to carry tag `tag`.
    Applied by index, so applying a grant twice (a retried step) changes nothing."""

    index: int
    page_id: int
    tag: int


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: positions [start_pos, start_pos + len(token_ids)).

    Its K/V goes into page_ids[pos // page_size] at slot pos % page_size; attention reads
    positions [0, end_pos). Generated tokens arrive here too (a decode chunk is the last sampled
    token), which is how the runner's copy of the output grows.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int  # == num_computed_tokens before the step
    new_pages: list[PageGrant]  # page-table entries mapped since the runner last saw this request
    sample: bool  # the step reaches the last known token: sample the next one
    # Speculative decoding (docs/speculative.md), on decode chunks only:
    #
    #   position:  start_pos - a ... start_pos-1 | start_pos | end_pos ... end_pos + k - 1
    #   tokens:    accepted_token_ids (a)        | token_ids | spec_token_ids (k)
    #              in KV already, runner learns  | computed  | computed too, then verified
    #
    # Proposed tokens to verify this step: K/V goes into their slots and every one gets logits.
    spec_token_ids: list[int] = field(default_factory=list)
    # Tokens the last step accepted from proposals (already in the pages, never computed again).
    accepted_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class PackedPages:
    """Whole K/V pages as raw bytes in one KV format (densa.formats.kv_format), as
    densa/worker/kv_io.py packs them on one worker and lands them on another:

        values      [num_layers, num_parts, num_pages, num_heads, page_size, head_dim]
                    in the format's storage dtype (num_parts: 2 for K and V)
        row_scales  [num_layers, num_parts, num_pages, num_heads, page_size] when the format
                    keeps one scale per row (FP8 dynamic: int8 exponents; INT8: fp16), else None
        static      [num_layers][num_parts] static FP8 scales, else empty
        index       sparse attention's index keys of the same pages, packed the same way in
                    their own format ([indexer layers, 1, num_pages, blocks, page_size, block]);
                    None for models without them
    """

    kv_dtype: str  # KVFormat.name
    kv_scales: str  # KVFormat.scales
    shape: tuple[int, ...]  # of `values`
    values: memoryview
    row_scales: memoryview | None = None
    static_scales: list[list[float]] = field(default_factory=list)
    index: PackedPages | None = None


@dataclass(frozen=True)
class KVLanding:
    """K/V copied in from elsewhere: the runner writes `pages` into `page_ids` (converting the
    format where it differs), but only if every page still carries the tag in `page_tags`;
    otherwise nothing is written and the writer alone fails (its id is among the errors of the
    runner's output).

    Two writers land pages: a receiving request's prompt (disaggregation), which then runs from
    `first_token_id`, sampled where its prompt was computed; and a KV tier's fetch (its writer
    id is the fetch's, `first_token_id` None), whose pages the prefix cache indexes once they
    are written."""

    request_id: str  # the writer: a receiving request, or a tier fetch
    page_ids: list[int]
    page_tags: list[int]
    pages: PackedPages
    # The runner advances the request's random stream past this token's draw, so a seeded
    # request's tokens after it are those one worker would have drawn. None: no request runs
    # from these pages (a tier fetch).
    first_token_id: int | None = None
    first_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0  # prompt tokens the computing side served from its own cache

    @property
    def starts_request(self) -> bool:
        return self.first_token_id is not None


@dataclass(frozen=True)
class KVExport:
    """Pages to copy out, every layer and part in the cache's own format, before the step writes
    any page: the runner answers with their PackedPages under `export_id` (RunnerOutput.exported).
    No tag is checked: the pages may be free (their bytes are intact until a step writes them),
    and whoever asked decides what the bytes are worth (a KV tier keys them by block hash)."""

    export_id: str
    page_ids: list[int]


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledChunk]
    # (page, tag) for every tag change since the last step -- pages allocated or released -- which
    # the runner mirrors into its device-side tag table before any read or write.
    tag_updates: list[tuple[int, int]]
    # Requests that ended or were preempted since the last step: the runner drops their state.
    finished_request_ids: list[str]
    preempted_request_ids: list[str]
    # Requests admitted (first scheduled, or re-admitted after preemption) in this step. They are
    # also the first suspects when a step fails (engine fault confinement).
    new_requests: list[NewRequest] = field(default_factory=list)
    # Copied-in K/V to write before this step reads any page (tags are updated first).
    kv_landings: list[KVLanding] = field(default_factory=list)
    # Pages to copy out before this step (its landings included) writes any page.
    kv_exports: list[KVExport] = field(default_factory=list)

    @property
    def new_request_ids(self) -> list[str]:
        return [r.request_id for r in self.new_requests]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) + len(s.spec_token_ids) for s in self.scheduled)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens this step verifies."""
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.kv_landings and not self.kv_exports
