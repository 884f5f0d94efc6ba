"""How many KV pages an engine gets: its byte budget (an exact page count, bytes, a share of free
memory, or auto), turned into whole pages of the target's (and a draft model's) KV format."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import psutil
import torch

from densa.config import (
    AUTO_KV_MAX_FRACTION,
    DRAFT_METHODS,
    CacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from densa.formats.kv_format import KVFormat
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.kv_pages import page_bytes
from densa.spec.draft import draft_kv_format, draft_page_bytes
from densa.utils.sizes import format_bytes

# The auto budget sizes its requests at this many tokens (or max_model_len, if shorter): the
# default max_model_len is the model's trained context (32k for Qwen2.5), and room for
# max_num_seqs requests that long would take half the machine's memory for a length few
# requests reach. It always holds one request of max_model_len.
AUTO_KV_TOKENS_PER_SEQ = 4096


def auto_kv_pages(scheduler: SchedulerConfig, page_size: int) -> int:
    """Pages the auto budget wants: max_num_seqs requests of min(max_model_len, 4096) tokens,
    and at least one request of max_model_len."""
    max_len = scheduler.max_model_len
    typical = -(-min(max_len, AUTO_KV_TOKENS_PER_SEQ) // page_size)
    return max(scheduler.max_num_seqs * typical, -(-max_len // page_size))


@dataclass(frozen=True)
class KVBudget:
    num_bytes: int
    reason: str  # how it was chosen, for the start-up log


def kv_budget(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    arch: ArchConfig,
    kv_format: KVFormat,
    device: torch.device,
) -> KVBudget:
    """The KV cache's byte budget, and why (an explicit size, a share of free memory, or auto)."""
    page = page_bytes(arch, cache.page_size, kv_format)
    if cache.exact_num_pages is not None:
        return KVBudget(cache.exact_num_pages * page, f"--num-kv-pages {cache.exact_num_pages}")
    free = _free_memory(device)
    budget = cache.budget()
    if isinstance(budget, int):
        if budget > free:
            raise ModelLoadError(
                f"--kv-cache-memory {cache.memory} is more than the "
                f"{format_bytes(free)} of memory free; lower it"
            )
        return KVBudget(budget, f"--kv-cache-memory {cache.memory}")
    if isinstance(budget, float):
        return KVBudget(int(free * budget), f"{budget:.0%} of {format_bytes(free)} free")
    max_len, max_num_seqs = scheduler.max_model_len, scheduler.max_num_seqs
    wanted = auto_kv_pages(scheduler, cache.page_size) * page
    cap = int(free * AUTO_KV_MAX_FRACTION)
    typical = min(max_len, AUTO_KV_TOKENS_PER_SEQ)
    reason = f"room for {max_num_seqs} requests x {typical} tokens"
    if typical < max_len:
        reason += f" and one of {max_len}"
    if wanted > cap:
        reason += f", capped at {AUTO_KV_MAX_FRACTION:.0%} of {format_bytes(free)} free"
    return KVBudget(min(wanted, cap), reason)


def is_relative(cache: CacheConfig) -> bool:
    """Whether the KV budget depends on the memory left once the weights are loaded."""
    return cache.exact_num_pages is None and not isinstance(cache.budget(), int)


def _free_memory(device: torch.device) -> int:
    if device.type == "cpu":
        return int(psutil.virtual_memory().available)
    return int(torch.cuda.mem_get_info(device)[0])


def resolve_num_pages(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    arch: ArchConfig,
    kv_format: KVFormat,
    device: torch.device,
    draft_page: int = 0,
    fit: bool = False,
) -> tuple[int, KVBudget]:
    """The target's KV pages. A draft model (`draft_page` bytes a page, see
    `draft_kv_page_bytes`) gets as many pages of its own, out of the same budget: a share of
    memory buys pages of (target + draft) bytes; an exact --num-kv-pages is the target's, the
    draft's pages coming on top. `fit`: max_model_len was not given, so a budget that holds
    fewer tokens than it is no error (`fit_max_model_len` shortens it), only one of no page."""
    budget = kv_budget(cache, scheduler, arch, kv_format, device)
    target_page = page_bytes(arch, cache.page_size, kv_format)
    if cache.exact_num_pages is not None:
        num_pages = cache.exact_num_pages
    else:
        num_pages = budget.num_bytes // (target_page + draft_page)
    if draft_page:
        budget = dataclasses.replace(
            budget, reason=f"{budget.reason}; a draft model takes {format_bytes(draft_page)}/page"
        )
    max_len = scheduler.max_model_len
    needed = 1 if fit else -(-max_len // cache.page_size)
    if num_pages < needed:
        raise ModelLoadError(
            f"the KV cache budget ({format_bytes(budget.num_bytes)}, {budget.reason}) holds "
            f"{num_pages} pages but one {max_len}-token request needs {needed}; "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    return num_pages, budget


def draft_kv_page_bytes(
    speculative: SpeculativeConfig | None, page_size: int, kv_format: KVFormat
) -> int:
    """Bytes of one page of the draft model's KV (0 without a draft model)."""
    if speculative is None or speculative.method not in DRAFT_METHODS or not speculative.model:
        return 0
    return draft_page_bytes(speculative.model, page_size, draft_kv_format(kv_format))


def fit_max_model_len(max_len: int, num_pages: int, page_size: int) -> int:
    """max_model_len as the default chooses it (like llama.cpp's --fit): the model's trained
    context `max_len` where one request of it fits in the KV pages, else the most they hold."""
    return min(max_len, num_pages * page_size)
