"""The draft-model proposer: a small model of the same tokenizer guesses k tokens greedily.

It runs in the engine's process with its own paged KV cache (its own page pool and page tensors,
the same attention backend and kernels as the target). Per request it remembers which tokens its
pages hold; each `propose` call then

    1. keeps the longest prefix of those tokens that the target still agrees with (the target
       rejected the rest: their pages are freed, the slots left behind are overwritten later),
    2. catches up in one chunk forward on the tokens the target accepted since (and the bonus
       token), whose last row proposes the first token,
    3. decodes k - 1 more tokens greedily, all requests in one batch per step.

The k-th proposal is never fed back, so after a call the pages hold
`token_ids + proposals[:-1]`:

    cached:    t0 t1 ... tn-1 | p1 ... pk-1        (pk only proposed)
    next call: t0 t1 ... tn-1 | p1 .. pa  b        (a accepted, b the target's own token)
               kept ---------------------^ catch-up chunk = [b] (or [pa+1.., b] after a rejection)

Proposals are argmax tokens (point-mass drafts): the target's verification stays exact for
sampling too (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention import (
    AttentionBackend,
    AttentionGroup,
    build_group,
)
from densa.model.fused_decode import enable_fused_decode
from densa.model.interface import CausalLM
from densa.model.kv_layout import LayerCache
from densa.model.kv_pages import allocate_kv_caches, page_bytes
from densa.model.loader import auto_formats, load_model, resolve_model_dir
from densa.spec.paged_rows import (
    ChunkRow,
    OwnPages,
    chunk_metadata,
    free_pages_from,
    grow_pages,
    last_rows,
    page_table,
    positions_of,
    prefill_group,
    propose_greedily,
)
from densa.spec.proposer import PromptStates, SpecInput, TargetRows
from densa.text.tokenizer import Tokenizer, TokenizerLoadError
from densa.utils.logging import get_logger
from densa.utils.sizes import format_bytes

logger = get_logger(__name__)

# Catch-up chunks after the prompt up to this long run as decode rows (the fused decode path);
# longer ones (and prompts) run as prefill. After a verified step the chunk is the accepted
# tail and the target's own token: at most k + 1 tokens.
MAX_DECODE_ROWS = 16


@dataclass
class DraftSequence:
    """What the draft's pages hold for one request."""

    token_ids: list[int] = field(default_factory=list)  # position i's K/V is in the pages
    page_ids: list[int] = field(default_factory=list)  # page_ids[i // page_size] holds position i
    page_tags: list[int] = field(default_factory=list)  # their tags when allocated (paged_rows)


_Row = ChunkRow[DraftSequence]


class DraftModelProposer(OwnPages[DraftSequence]):
    """Proposes the draft model's own greedy continuation (see the module docstring)."""

    name = "draft"
    needs_hidden_states = False
    prompt_states: PromptStates | None = None  # nothing of it crosses a split

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[LayerCache],
        page_size: int,
        backend: AttentionBackend,
        device: torch.device,
        num_pages: int,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        """kv_caches: the draft's own page tensors, `num_pages` pages of `page_size` tokens."""
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.backend = backend
        self.device = device
        self.max_model_len = max_model_len  # positions the draft's RoPE tables cover
        # One draft decode step relative to the target's: set next to the target, which this
        # proposer does not see (setup/proposers.py). 0 until then.
        self.cost_per_token = 0.0
        self.catch_up_cost_per_token = 0.0  # set next to the target too
        # Proposals beyond the target's vocabulary (a draft's padded rows) could not be verified.
        self.vocab_size = vocab_size
        super().__init__(num_pages)

    # ---- the Proposer interface ------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        return propose_greedily(inputs, self.max_model_len, self._catch_up_row, self._step)

    def _step(self, step: int, rows: list[_Row]) -> list[tuple[int, _Row]]:
        """One forward; each row's tokens are in the pages now, its proposal feeds it on."""
        next_ids = self._forward(rows)
        for row in rows:
            row.seq.token_ids.extend(row.token_ids)
        return [(t, _Row(row.seq, [t], row.end_pos)) for row, t in zip(rows, next_ids, strict=True)]

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        """A draft model computes its own hidden states: the target's are not needed."""

    # ---- per-request KV --------------------------------------------------------------------------
    def _catch_up_row(self, spec: SpecInput, num_tokens: int) -> _Row | None:
        """Truncate the request's pages to what the target accepted, make room for this call's
        tokens, and return the catch-up chunk (None: no room in the draft's pool this step, and
        the request's pages are freed so it does not hold them while proposing nothing).

        Before anything reads the pages, their tags are checked: a page freed behind the
        request's back ends its speculation this step (its draft state is dropped, and rebuilt
        from its token ids next time). Only speculation: the draft's K/V decides proposals, never
        output (the target verifies every token), so the request itself goes on."""
        seq = self.sequences.setdefault(spec.request_id, DraftSequence())
        if self._dropped_if_stale(seq, spec.request_id):
            return None
        token_ids = list(spec.token_ids)
        # At least the last token is recomputed: its row is what proposes the first token.
        keep = min(_common_prefix_len(seq.token_ids, token_ids), len(token_ids) - 1)
        del seq.token_ids[keep:]
        self._truncate_pages(seq, keep)
        # K/V is written for the chunk and for proposals 1..k-1.
        if not grow_pages(self.pool, seq, len(token_ids) + num_tokens - 1, self.page_size):
            self.release(spec.request_id)
            return None
        return _Row(seq, token_ids[keep:], keep)

    def _truncate_pages(self, seq: DraftSequence, num_tokens: int) -> None:
        """Roll back to num_tokens positions: pages wholly past them are freed (tags bumped)."""
        num_pages = -(-num_tokens // self.page_size)
        if len(seq.page_ids) > num_pages:
            free_pages_from(self.pool, seq, num_pages)

    # ---- the forward pass ------------------------------------------------------------------------
    def _forward(self, rows: list[_Row]) -> list[int]:
        """The argmax next token after each row's chunk; writes the chunks' K/V. Short chunks
        (a decode, or the few tokens the target accepted since the last call) run as decode
        rows, one per token, so decode-only passes keep the fused path; a prompt's chunk runs
        as prefill, in a pass of its own."""
        short = [i for i, row in enumerate(rows) if _as_decode_rows(row)]
        long = [i for i, row in enumerate(rows) if not _as_decode_rows(row)]
        next_ids = [0] * len(rows)
        for part, as_decode in ((short, True), (long, False)):
            if part:
                tokens = self._forward_group([rows[i] for i in part], as_decode)
                for i, token_id in zip(part, tokens, strict=True):
                    next_ids[i] = token_id
        return next_ids

    def _forward_group(self, rows: list[_Row], as_decode: bool) -> list[int]:
        token_ids = [t for row in rows for t in row.token_ids]
        positions_t = positions_of(rows)
        if as_decode:
            group = self._decode_rows(rows)
        else:
            group = prefill_group(rows, self.page_size, self.device)
        meta = chunk_metadata(rows, positions_t, group, as_decode, self.page_size, self.device)
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions_t.to(self.device),
            self.kv_caches,
            meta,
            self.backend,
        )  # [T, hidden]
        ends = torch.tensor(last_rows(rows), device=self.device)
        logits = self.model.compute_logits(hidden[ends])[:, : self.vocab_size]  # [B, V]
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _decode_rows(self, rows: list[_Row]) -> AttentionGroup:
        """One decode row per token: the row at position p attends to [0, p] (every layer stores
        all rows' K/V before any row attends, so later rows read earlier ones from the pages),
        exactly as if the tokens had been decoded one by one."""
        page_tables, seq_lens = [], []
        for row in rows:
            pages = page_table(row, self.page_size)
            for position in range(row.start_pos, row.end_pos):
                page_tables.append(pages)
                seq_lens.append(position + 1)
        return build_group(0, page_tables, seq_lens, [1] * len(seq_lens), self.page_size,
                           self.device)  # fmt: skip


def _as_decode_rows(row: _Row) -> bool:
    """Whether a chunk runs as decode rows: a short one after the prompt. A prompt is computed
    as prefill, as the target computes it."""
    return row.start_pos > 0 and len(row.token_ids) <= MAX_DECODE_ROWS


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, draft_name: str) -> None:
    """Refuse a draft whose token ids mean other text than the target's: its proposals would be
    verified as the wrong tokens (accepted rarely, and never useful)."""
    if target.vocab_size != draft.vocab_size:
        raise ModelLoadError(
            f"the draft model {draft_name} has a tokenizer of {draft.vocab_size} tokens but the "
            f"target's has {target.vocab_size}; a draft must share the target's tokenizer "
            "(use a smaller model of the same family)"
        )
    ids = list(range(target.vocab_size))
    target_pieces = target.convert_ids_to_tokens(ids)
    draft_pieces = draft.convert_ids_to_tokens(ids)
    for token_id, (mine, theirs) in enumerate(zip(target_pieces, draft_pieces, strict=True)):
        if mine != theirs:
            raise ModelLoadError(
                f"the draft model {draft_name} does not share the target's tokenizer: token "
                f"{token_id} is {theirs!r} in the draft and {mine!r} in the target; use a "
                "smaller model of the same family"
            )


def draft_vocab_size(target: ArchConfig, draft: ArchConfig) -> int:
    """Token ids both models' output heads cover."""
    return min(target.vocab_size, draft.vocab_size)


FLOAT32_PAGES = KVFormat.of("float32")


@dataclass(frozen=True)
class DraftSpec:
    """How to build a draft proposer next to a target (the engine builder fills it)."""

    model: str  # a path densa's loader takes (catalog names are resolved before)
    page_size: int
    num_pages: int  # the draft's own pages (setup/builder.py: as many tokens as the target's)
    max_model_len: int
    dtype: str = "float32"
    weight_format: str = "auto"  # resolved as the target's is: a GGUF draft runs from its blocks
    head_format: str = "auto"
    kv_format: KVFormat = FLOAT32_PAGES  # see draft_kv_format


def draft_kv_format(target: KVFormat) -> KVFormat:
    """The draft's pages: the target's dtype, FP8 with dynamic scales (no calibration measures
    the draft), index keys (if any) in the pages' dtype."""
    return KVFormat.of(target.name)


def load_draft_proposer(
    spec: DraftSpec,
    target_arch: ArchConfig,
    target_tokenizer: Tokenizer,
    backend: AttentionBackend,
    device: torch.device,
) -> DraftModelProposer:
    """Load the draft, refuse one whose tokenizer differs from the target's, give it its pages."""
    draft_dir = resolve_model_dir(spec.model)
    draft_arch = ArchConfig.from_dir(draft_dir)
    try:
        draft_tokenizer = Tokenizer.from_dir(draft_dir, draft_arch.eos_token_ids)
    except (TokenizerLoadError, OSError) as exc:
        raise ModelLoadError(f"cannot load the draft's tokenizer in {draft_dir}: {exc}") from exc
    check_same_tokenizer(target_tokenizer, draft_tokenizer, spec.model)
    # "auto" resolved here as the builder resolves the target's: passed on as it is, a GGUF
    # draft would be dequantized to dense float weights (4x its file, and a slower pass).
    weights, head = auto_formats(spec.model, draft_dir, spec.weight_format, spec.head_format)
    model = load_model(draft_dir, draft_arch, spec.dtype, spec.max_model_len, device, weights, head)
    kv_caches = allocate_kv_caches(
        draft_arch, spec.num_pages, spec.page_size, spec.kv_format, device
    )
    fused = backend.capabilities.fused_decode and enable_fused_decode(model, kv_caches) is None
    logger.info(
        "draft model %s (%s weights, %s head): %d KV pages x %d tokens (%s), fused decode %s",
        draft_dir.name, weights, head, spec.num_pages, spec.page_size,
        format_bytes(spec.num_pages * page_bytes(draft_arch, spec.page_size, spec.kv_format)),
        "on" if fused else "off",
    )  # fmt: skip
    return DraftModelProposer(
        model, kv_caches, spec.page_size, backend, device, spec.num_pages,
        spec.max_model_len, draft_vocab_size(target_arch, draft_arch),
    )  # fmt: skip


def draft_page_bytes(model: str, page_size: int, kv_format: KVFormat) -> int:
    """Bytes of one page of the draft's KV, read from its config alone (before any load)."""
    arch = ArchConfig.from_dir(resolve_model_dir(model))
    return page_bytes(arch, page_size, kv_format)
