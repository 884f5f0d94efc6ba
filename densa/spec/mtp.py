"""The multi-token-prediction (MTP) proposer of DeepSeek-V3-class checkpoints.

The checkpoint's config says `num_nextn_predict_layers` (1 for DeepSeek-V3 and Kimi K2); those
layers are stored after the model's own, as `model.layers.{N}.*` with N = num_hidden_layers
(the target's loader drops them: densa/model/deepseek_v3.py). Layer N is

    x_p   = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])     h_p: the target's final hidden
    o_p   = decoder layer N (MLA attention over its own KV, MoE MLP), residual added
    logits_p = shared_head.head(shared_head.norm(o_p))        predicts t_{p+2}

so at the newest position it proposes the token after the target's next one. Further proposals
feed the layer its own output o_p as the next h (one MTP layer, applied k times).

The layer keeps its own paged latent KV, one row per position p, computed from the target's
true h_p. `observe_hidden` hands those over (the engine passes the hidden states of every
position the target puts in its KV: prompt chunks, and the accepted rows of a verifying step).
A position's row is exact once h_p and t_{p+1} are both known; rows of the k - 1 self-fed
positions are recomputed next call from the target's own states:

    positions:  0 .. n-2          | n-1 .. n+k-3
                exact (target h)  | self-fed: overwritten on the next call

A request that does not propose for a while (its batch too large to speculate, a low
acceptance) would keep every h_p it is handed until it proposes again; once FOLD_ROWS of them
wait, they are folded into exact rows at once (the same work a later catch-up would do), so a
request holds at most FOLD_ROWS + 2 hidden states. A request whose positions were not all seen
from 0 on (a prefix-cache hit, a state dropped or never landed) cannot have exact rows: the
proposer ignores it and it decodes without MTP proposals.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import nn

from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention import AttentionBackend, AttentionMetadata
from densa.model.checkpoint_files import iter_checkpoint, safetensors_files
from densa.model.deepseek_v3 import DeepseekV3DecoderLayer
from densa.model.deepseek_v32 import SparseDecoderLayer
from densa.model.family_config import MoEConfig
from densa.model.kv_layout import LatentKVCache, LayerCache
from densa.model.kv_pages import allocate_kv_caches
from densa.model.layers import RMSNorm, RotaryEmbedding
from densa.model.linear import Linear
from densa.model.loader import DTYPES
from densa.model.moe import stack_experts
from densa.model.registry import model_factory
from densa.model.weight_loading import GATE_UP_FUSED, FusedWeightLoader
from densa.spec.paged_rows import (
    ChunkRow,
    OwnPages,
    chunk_metadata,
    free_pages_from,
    grow_pages,
    last_rows,
    positions_of,
    prefill_group,
    propose_greedily,
)
from densa.spec.proposer import PromptState, PromptStates, SpecInput, TargetRows
from densa.worker import kv_io

# Tensors of the MTP layer that are its own; the rest are the decoder layer's ("block.").
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
# Hidden states a request may hold beyond its exact rows before they are folded into rows: a
# 64-position chunk of one layer is cheap, and 64 x H values per request bound its memory.
FOLD_ROWS = 64


class SharedHead(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(nn.Module):
    """One DeepSeek-V3 MTP layer (see the module docstring), named as the checkpoint names it."""

    def __init__(self, cfg: ArchConfig, max_position: int, device: torch.device) -> None:
        super().__init__()
        if cfg.moe is None or cfg.mla is None:
            raise ValueError("an MTP layer needs the DeepSeek-V3 MoE and MLA settings")
        hidden = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        # The layer after the model's last: MoE as every DeepSeek layer past the dense ones.
        moe = dataclasses.replace(cfg.moe, moe_layers=(*cfg.moe.moe_layers, cfg.moe.moe_layers[-1]))
        self.block = _decoder_layer(cfg, moe)
        self.shared_head = SharedHead(cfg)
        self.rotary = RotaryEmbedding(
            cfg.mla.rope_head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device=device
        )
        self.num_experts = cfg.moe.num_experts

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        prev_hidden: torch.Tensor,
        cache: LatentKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids (t_{p+1}), positions (p): [T]; prev_hidden (h_p): [T, H] -> o_p [T, H]."""
        embedded = self.enorm(self.embed_tokens(input_ids))
        hidden = self.eh_proj(torch.cat([embedded, self.hnorm(prev_hidden)], dim=-1))  # [T, H]
        rope = self.rotary.lookup(positions, hidden.dtype)
        out, residual = self.block(rope, hidden, None, cache, meta, backend)[:2]
        return cast(torch.Tensor, out + residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden)).float()

    def load_checkpoint(self, model_dir: Path, layer_idx: int) -> None:
        """Copy `model.layers.{layer_idx}.*` of the checkpoint in (every parameter must fill)."""
        prefix = f"model.layers.{layer_idx}."
        tensors = (
            (_module_name(name.removeprefix(prefix)), tensor)
            for name, tensor in iter_checkpoint(safetensors_files(model_dir))
            if name.startswith(prefix)
        )
        try:
            stacked = cast(
                Iterator[tuple[str, torch.Tensor]], stack_experts(tensors, self.num_experts)
            )
            FusedWeightLoader(GATE_UP_FUSED).load(self, stacked)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"the MTP layer in {model_dir} does not load: {exc}") from exc


def _decoder_layer(cfg: ArchConfig, moe: MoEConfig) -> nn.Module:
    """The MTP layer's decoder layer: DeepSeek-V3's, or with sparse attention (GLM-5,
    DeepSeek-V3.2) one that runs its own indexer over its own index keys."""
    if cfg.dsa is None:
        return DeepseekV3DecoderLayer(cfg, moe, cfg.num_layers)
    family = model_factory(cfg.architecture)
    interleave = cfg.dsa.rope_interleave
    if interleave is None:
        interleave = bool(getattr(family, "INDEXER_ROPE_INTERLEAVE", False))
    return SparseDecoderLayer(with_mtp_indexer(cfg), moe, cfg.num_layers, interleave)


def with_mtp_indexer(cfg: ArchConfig, num_layers: int | None = None) -> ArchConfig:
    """`cfg` with the MTP layer's indexer: after the model's layers, or as the only one of
    `num_layers=1` (the MTP pool's geometry)."""
    assert cfg.dsa is not None
    full = (*cfg.dsa.full_layers, True) if num_layers is None else (True,) * num_layers
    return dataclasses.replace(cfg, dsa=dataclasses.replace(cfg.dsa, full_layers=full))


def _module_name(name: str) -> str:
    """A checkpoint name inside the MTP layer -> its parameter's name in MTPLayer."""
    if name.startswith(_OWN):
        return name
    return "block." + name.replace(".shared_experts.", ".shared_expert.")


def num_mtp_layers(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("num_nextn_predict_layers") or 0)


@dataclass
class MTPSequence:
    """One request's MTP state: the target's hidden states and the MTP layer's pages."""

    # h_p for positions [hidden_start, num_hidden), in [n_i, H] chunks, and the t_{p+1} each
    # pairs with (all but the newest); those before num_exact are dropped once their KV rows
    # are written (a request keeps few of them).
    hidden: list[torch.Tensor] = field(default_factory=list)
    next_token_ids: list[int] = field(default_factory=list)
    hidden_start: int = 0
    num_hidden: int = 0
    num_exact: int = 0  # positions [0, num_exact) hold rows computed from the target's h
    page_ids: list[int] = field(default_factory=list)
    page_tags: list[int] = field(default_factory=list)  # their tags when allocated (paged_rows)

    def hidden_rows(self, start: int, end: int) -> torch.Tensor:
        """h_p for p in [start, end) ([end - start, H]); chunks merge once read."""
        if len(self.hidden) > 1:
            self.hidden = [torch.cat(self.hidden)]
        return self.hidden[0][start - self.hidden_start : end - self.hidden_start]

    def drop_hidden_before(self, position: int) -> None:
        if self.hidden and position > self.hidden_start:
            self.hidden = [torch.cat(self.hidden)[position - self.hidden_start :]]
            self.next_token_ids = self.next_token_ids[position - self.hidden_start :]
            self.hidden_start = position


@dataclass(frozen=True)
class _Row(ChunkRow[MTPSequence]):
    """token_ids: t_{p+1} for each position p of the chunk."""

    hidden: torch.Tensor = field(kw_only=True)  # h_p, [len(token_ids), H]


class MTPProposer(OwnPages[MTPSequence]):
    """Proposes with the checkpoint's MTP layer from the target's hidden states."""

    name = "mtp"
    needs_hidden_states = True  # it reads the target's final hidden state of every position

    def __init__(
        self,
        layer: MTPLayer,
        cache: LatentKVCache,
        num_pages: int,
        page_size: int,
        backend: AttentionBackend,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.layer, self.cache = layer, cache
        self.page_size, self.backend, self.device = page_size, backend, device
        self.max_model_len = max_model_len
        super().__init__(num_pages)
        # One pass of the layer relative to a target step: set next to the target
        # (setup/proposers.py). 0 until then.
        self.cost_per_token = 0.0
        self.catch_up_cost_per_token = 0.0  # its rows are folded whether it proposes or not
        self.prompt_states: PromptStates | None = self  # its rows cross a prefill/decode split

    def observe_hidden(self, request_id: str, rows: TargetRows) -> None:
        """The target's final hidden states of the next positions it put in its KV; folded into
        rows once FOLD_ROWS of them wait (module docstring)."""
        seq = self.sequences.get(request_id)
        if seq is None and rows.start_pos == 0:
            seq = self.sequences[request_id] = MTPSequence()
        if seq is None:
            return  # positions before start_pos were never seen: no exact rows can exist
        if rows.start_pos != seq.num_hidden:
            self.release(request_id)  # a gap: the rows after it could not be exact
            return
        seq.hidden.append(rows.hidden.detach().to(self.device).clone())  # not the step's view
        # t_s pairs with h_{s-1}; the prompt's first token pairs with nothing
        seq.next_token_ids.extend(rows.token_ids[1:] if rows.start_pos == 0 else rows.token_ids)
        seq.num_hidden += len(rows.token_ids)
        if seq.num_hidden - 1 - seq.num_exact > FOLD_ROWS:
            self._fold(request_id, seq)

    @torch.inference_mode()
    def _fold(self, request_id: str, seq: MTPSequence) -> None:
        """Write the exact rows of positions [num_exact, num_hidden - 1) now (each pairs h_p
        with t_{p+1}), keeping only the newest h; no room in the pool or a stale page: the
        request's MTP state goes, and it decodes on without proposals."""
        if self._dropped_if_stale(seq, request_id):
            return
        end = seq.num_hidden - 1
        if not grow_pages(self.pool, seq, end, self.page_size):
            self.release(request_id)
            return
        start = seq.num_exact
        token_ids = seq.next_token_ids[start - seq.hidden_start : end - seq.hidden_start]
        self._step(0, [_Row(seq, token_ids, start, hidden=seq.hidden_rows(start, end))])

    @torch.inference_mode()
    def propose(self, inputs: Sequence[SpecInput]) -> list[list[int]]:
        return propose_greedily(inputs, self.max_model_len, self._catch_up_row, self._step)

    # ---- a prefill/decode split ------------------------------------------------------------------
    @torch.inference_mode()
    def export_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> PromptState | None:
        """Prefill side: the prompt's rows (computed now where they are not yet: one chunk) and
        its last hidden state. None when the target's hidden states of the prompt were not all
        observed, a page is stale, or the pool has no room: the decode side then gets no state,
        and the request decodes without MTP proposals."""
        seq = self.sequences.get(request_id)
        n = len(prompt_token_ids)
        if seq is None or seq.num_hidden < n or n < 1 or seq.hidden_start > seq.num_exact:
            return None
        if self._dropped_if_stale(seq, request_id):
            return None
        if seq.num_exact < n - 1:
            if not grow_pages(self.pool, seq, n - 1, self.page_size):
                return None
            start = seq.num_exact
            token_ids = [int(t) for t in prompt_token_ids[start + 1 : n]]
            self._forward([_Row(seq, token_ids, start, hidden=seq.hidden_rows(start, n - 1))])
            seq.num_exact = n - 1
        hidden = seq.hidden_rows(n - 1, n).float().cpu()
        page_ids = seq.page_ids[: -(-(n - 1) // self.page_size)]
        return PromptState(n - 1, hidden, page_ids, kv_io.pack([self.cache], page_ids))

    def land_prompt(self, request_id: str, state: PromptState) -> bool:
        """Decode side: take a prompt's state from the prefill side into pages of this pool
        (allocated and tagged now, written at once: no writer is in flight). False, keeping
        nothing, when the pool has no room, the pages do not fit the layer, or the hidden state
        is not finite: the request then decodes without MTP proposals."""
        self.release(request_id)
        if state.pages is None or not bool(torch.isfinite(state.hidden).all()):
            return False
        hidden = state.hidden.to(self.device, self.layer.eh_proj.weight.dtype)
        n = state.num_positions + 1
        seq = MTPSequence([hidden], hidden_start=n - 1, num_hidden=n, num_exact=n - 1)
        if not grow_pages(self.pool, seq, state.num_positions, self.page_size):
            return False
        try:
            if seq.page_ids:
                kv_io.land([self.cache], seq.page_ids, state.pages)
        except kv_io.LandingError:
            free_pages_from(self.pool, seq, 0)
            return False
        self.sequences[request_id] = seq
        return True

    def _step(self, step: int, rows: list[_Row]) -> list[tuple[int, _Row]]:
        """One forward; a row's next input is its proposal and its own output hidden state."""
        next_ids, out_hidden = self._forward(rows)
        fed = []
        for i, row in enumerate(rows):
            if step == 0:
                row.seq.num_exact = row.end_pos
                # the newest exact row is recomputed next call: keep its h
                row.seq.drop_hidden_before(row.end_pos - 1)
            fed.append(_Row(row.seq, [next_ids[i]], row.end_pos, hidden=out_hidden[i : i + 1]))
        return list(zip(next_ids, fed, strict=True))

    def _catch_up_row(self, spec: SpecInput, num_tokens: int) -> _Row | None:
        """Positions [num_exact, n - 1): t_{p+1} and the target's h_p; None if the target's
        hidden states of the positions before the last token have not all been observed, or
        the pool has no room."""
        seq = self.sequences.get(spec.request_id)
        n = len(spec.token_ids)
        if seq is None or seq.num_hidden < n - 1 or n < 2:
            return None
        if self._dropped_if_stale(seq, spec.request_id):  # its rows are gone: no proposals
            return None
        start = min(seq.num_exact, n - 2)  # at least the newest position: it proposes
        end_pos = n - 1 + num_tokens - 1  # rows written: exact ones, then k - 1 self-fed
        if not grow_pages(self.pool, seq, end_pos, self.page_size):
            return None
        token_ids = [int(t) for t in spec.token_ids[start + 1 : n]]
        return _Row(seq, token_ids, start, hidden=seq.hidden_rows(start, n - 1))

    def _forward(self, rows: list[_Row]) -> tuple[list[int], torch.Tensor]:
        """Argmax next token and output hidden state of each row's last position."""
        positions_t = positions_of(rows)
        group = prefill_group(rows, self.page_size, self.device)
        as_decode = all(len(row.token_ids) == 1 for row in rows)
        meta = chunk_metadata(rows, positions_t, group, as_decode, self.page_size, self.device)
        out = self.layer(
            torch.tensor([t for row in rows for t in row.token_ids], device=self.device),
            positions_t.to(self.device),
            torch.cat([row.hidden for row in rows]).to(self.layer.eh_proj.weight.dtype),
            self.cache,
            meta,
            self.backend,
        )  # [T, H]
        ends = torch.tensor(last_rows(rows), device=self.device)
        last = out[ends]  # [B, H]
        next_ids = self.layer.compute_logits(last).argmax(dim=-1).tolist()
        return [int(t) for t in next_ids], last


def load_mtp_proposer(
    model_dir: Path,
    arch: ArchConfig,
    dtype: str,
    num_pages: int,
    page_size: int,
    backend: AttentionBackend,
    device: torch.device,
    max_model_len: int,
) -> MTPProposer:
    """The checkpoint's first MTP layer, with as many latent KV pages (one layer) as given."""
    if num_mtp_layers(model_dir) < 1:
        raise ModelLoadError(
            f"{model_dir.name} has no multi-token-prediction layer (num_nextn_predict_layers "
            "is 0 or missing): use --speculative-method ngram or a draft model"
        )
    layer = MTPLayer(arch, max_model_len, device).to(device=device, dtype=DTYPES[dtype])
    layer.load_checkpoint(model_dir, arch.num_layers)
    one_layer = dataclasses.replace(arch, num_layers=1)
    if arch.dsa is not None:  # its pages hold the layer's index keys too
        one_layer = with_mtp_indexer(one_layer, num_layers=1)
    caches: list[LayerCache] = allocate_kv_caches(
        one_layer, num_pages, page_size, KVFormat.of("float32"), device
    )
    cache = caches[0]
    assert isinstance(cache, LatentKVCache)
    return MTPProposer(layer.eval(), cache, num_pages, page_size, backend, device, max_model_len)
