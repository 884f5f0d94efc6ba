"""Will it fit? The memory a model needs, checked against what is available before anything
loads (issue 21, point 3), so a model too large for the machine fails in one line naming what
would fit, not minutes later in the kernel's OOM killer.

    needed = weights, resident as executed
           + max(the load's transient,  KV cache + activations)
           + RUNTIME_ALLOWANCE

The weights are measured on the load's own plan (`loader.plan_load`, made once by the builder
and then loaded: a meta-device model from the GGUF header's tensor types or the safetensors
metadata, no tensor read): GGUF layers kept in their blocks, the other linears packed from
float32 into a packed `--weight-format`, the output head in its format, everything else in the
compute dtype. The load's transient is whichever is larger of (a) the dense copies of the layers
packed only once all are loaded, plus the largest tensor dequantized to float32 twice (the
decoded array and the model's row-order copy), and (b) the huge-page copy `rehome_on_huge_pages`
makes of every weight at once (CPU). The KV cache is the budget the builder will allocate,
resolved the same way; KV pages and activations only exist after the load, so they compete with
the transient, not add to it.

Lives in setup/ (not model/) because it needs the KV sizing (worker/) and the whole config.
Skipped with --skip-memory-check or DENSA_SKIP_MEMORY_CHECK=1, and off the CPU (a GPU's weights
are checked against its own free memory by the loader).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from densa.cache.tiers.tier import parse_tier_spec
from densa.config import (
    AUTO_KV_MAX_FRACTION,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import native, qgemm
from densa.kernels.cpu.prefill_attention import KEY_BLOCK
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.interface import CausalLM
from densa.model.kv_pages import page_bytes
from densa.model.loader import LoadPlan, plan_load  # the loader's own plan
from densa.model.packed_linear import packed_bytes
from densa.model.quant_targets import OUTPUT_HEAD
from densa.model.runtime_weights import (
    quantizable_linears,
)
from densa.quant.linear_format import HeadFormat, LinearFormat
from densa.setup.kv_sizing import auto_kv_pages, is_relative
from densa.setup.loading import ModelLoads, plan_loads
from densa.utils.sizes import format_bytes

# What a serving process grows by besides weights, KV pages and activations: the mmapped GGUF
# pages read, the tokenizer, Numba's and the C++ kernels' scratch, freed memory the allocator
# keeps. SmolLM2-135M (Q4_1, 200 MiB of w4a8 weights, 64 MiB of KV) grew 308 MiB beyond
# weights + KV by the end of start-up, and its peak 438 MiB beyond weights + the transient
# planned below; 400 MiB is also issue 21's runtime allowance.
RUNTIME_ALLOWANCE = 400 * 1024**2
SKIP_ENV = "DENSA_SKIP_MEMORY_CHECK"
_FLOAT32 = 4
_MiB = 1024**2
_NOTHING_FITS = "no smaller setting fits: free memory or pick a smaller model"


@dataclass(frozen=True)
class WeightPlan:
    resident_bytes: int  # after loading, in the formats the layers execute in
    transient_bytes: int  # on top of that at the load's peak
    describe: str  # e.g. "w4a8"

    def __add__(self, other: WeightPlan) -> WeightPlan:  # a second (decode) weight set
        return WeightPlan(
            self.resident_bytes + other.resident_bytes,
            max(self.transient_bytes, other.transient_bytes),
            f"{self.describe} + {other.describe}",
        )


@dataclass(frozen=True)
class MemoryPlan:
    weights: WeightPlan
    kv_bytes: int
    activation_bytes: int
    runtime_bytes: int = RUNTIME_ALLOWANCE
    host_tier_bytes: int = 0  # --kv-tier host:SIZE fills up after the load, like KV pages

    @property
    def needed_bytes(self) -> int:
        after_load = self.kv_bytes + self.activation_bytes + self.host_tier_bytes
        return (
            self.weights.resident_bytes
            + max(self.weights.transient_bytes, after_load)
            + (self.runtime_bytes)
        )

    def describe(self) -> str:
        w = self.weights
        return (
            f"weights {format_bytes(w.resident_bytes)} as {w.describe} (+"
            f"{format_bytes(w.transient_bytes)} while loading), KV cache "
            f"{format_bytes(self.kv_bytes)}, activations {format_bytes(self.activation_bytes)}, "
            f"runtime {format_bytes(self.runtime_bytes)}"
        ) + (f", host KV tier {format_bytes(self.host_tier_bytes)}" if self.host_tier_bytes else "")


# ---- the weights -------------------------------------------------------------------------------
def plan_weights(
    model_dir: Path,
    arch: ArchConfig,
    dtype: str,
    max_len: int,
    device: torch.device,
    weight_format: str | LinearFormat,
    head_format: str | HeadFormat,
) -> WeightPlan:
    """The bytes `load_model(model_dir, ...)` will hold, from headers only (a meta model)."""
    return planned_weights(
        plan_load(model_dir, arch, dtype, max_len, device, weight_format, head_format)
    )


def planned_weights(load: LoadPlan) -> WeightPlan:
    """The bytes the planned load will hold, and its transient on top."""
    model, packed, head_format = load.model, load.packed, load.head_format
    tensors = _unique_tensors(model)
    resident = sum(_nbytes(t) for t in tensors)
    repack = _repacked_bytes(model, packed) if packed else 0
    head = _head_bytes(model, head_format)
    largest = max((t.numel() for t in tensors), default=0) * _FLOAT32
    final = resident - repack + head
    transient = repack + 2 * largest
    if load.device.type == "cpu":
        transient = max(transient, final)  # rehome_on_huge_pages copies every weight at once
    runtime = load.runtime
    linear = packed or (runtime.describe() if runtime is not None else load.dtype)
    describe = linear if head_format.is_dense else f"{linear}, head {head_format}"
    return WeightPlan(final, transient, describe)


def _unique_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    seen: set[int] = set()
    unique = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append(tensor)
    return unique


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _dense_and_packed(module: torch.nn.Module, fmt: str) -> tuple[int, int] | None:
    """(dense bytes, packed bytes) of a linear the packed format will replace, if it tiles."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    if not qgemm.fits(in_features, out_features):
        return None
    return _nbytes(weight), packed_bytes(fmt, out_features, in_features)


def _repacked_bytes(model: CausalLM, fmt: str) -> int:
    """Bytes saved by packing (after the load) the linears that did not keep GGUF blocks."""
    saved = 0
    for name in quantizable_linears(model):
        sizes = _dense_and_packed(model.get_submodule(name), fmt)
        if sizes is not None:
            saved += sizes[0] - sizes[1]
    return saved


def _head_bytes(model: CausalLM, head_format: HeadFormat) -> int:
    """What packing the output head changes: a tied head adds its packed copy (the embedding
    stays), an untied one replaces its dense weight."""
    if head_format.packed is None:  # dense, or GGUF blocks: swapped in the meta model already
        return 0
    head = model.get_submodule(OUTPUT_HEAD)
    sizes = _dense_and_packed(head, head_format.packed)
    if sizes is None:
        return 0
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    tied = any(e is getattr(head, "weight") for e in embeddings)  # noqa: B009
    return sizes[1] if tied else sizes[1] - sizes[0]


# ---- KV cache, activations, the whole plan -----------------------------------------------------
def planned_kv_bytes(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    arch: ArchConfig,
    kv_format: KVFormat,
    free_after: int,
) -> int:
    """The KV budget the builder will allocate (kv_sizing.kv_budget, whole pages), where a share
    of free memory is a share of what the weights leave (`free_after`)."""
    page = page_bytes(arch, cache.page_size, kv_format)
    if cache.exact_num_pages is not None:
        return cache.exact_num_pages * page
    budget = cache.budget()
    if isinstance(budget, int):
        return budget // page * page
    share = budget if isinstance(budget, float) else AUTO_KV_MAX_FRACTION
    wanted = auto_kv_pages(scheduler, cache.page_size) * page
    cap = int(max(free_after, 0) * share)
    return (cap if isinstance(budget, float) else min(wanted, cap)) // page * page


def activation_bytes(scheduler: SchedulerConfig, arch: ArchConfig) -> int:
    """An allowance for one step's float32 activations: per batched token the residual stream,
    its norm, attention output and projections (8 x hidden), q|k|v, the gate|up product and
    its activation (3 x intermediate); prefill attention's scores, tiled over the context
    (kernels/cpu/prefill_attention.py: at most heads x tokens x KEY_BLOCK keys at once, the
    torch fallback's block; the C++ kernel's tiles are smaller), and the step's boolean mask
    (tokens x max_len bytes); logits, their softmax and the sampler's sorted copy per request."""
    tokens, max_len = scheduler.max_num_batched_tokens, scheduler.max_model_len
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_token = 8 * arch.hidden_size + 3 * arch.intermediate_size + qkv
    scores = arch.num_heads * tokens * min(max_len, KEY_BLOCK) + tokens * max_len // _FLOAT32
    logits = 3 * scheduler.max_num_seqs * arch.vocab_size
    return _FLOAT32 * (tokens * per_token + scores + logits)


def plan_memory(
    config: EngineConfig,
    model_dir: Path,
    arch: ArchConfig,
    kv_format: KVFormat,
    available: int,
    fit_context: bool = False,
    weights: WeightPlan | None = None,
) -> MemoryPlan:
    """What serving `model_dir` with this config needs at its peak. `fit_context`: the
    default max_model_len, shortened to what the budget holds, so one request of the model's
    whole context is no floor on the KV cache. `weights`: of the loads the builder planned
    (None: planned here)."""
    if weights is None:
        device = torch.device(config.device.device)
        weights = plan_all_weights(config.model, model_dir, arch, device)
    host_tier = host_tier_bytes(config.tiers.specs)
    free_after = available - weights.resident_bytes - RUNTIME_ALLOWANCE - host_tier
    kv = planned_kv_bytes(config.cache, config.scheduler, arch, kv_format, free_after)
    page = page_bytes(arch, config.cache.page_size, kv_format)
    if not fit_context:
        kv = max(kv, _one_request_bytes(config, page))  # less fails after the load
    return MemoryPlan(weights, kv, activation_bytes(config.scheduler, arch),
                      host_tier_bytes=host_tier)  # fmt: skip


def host_tier_bytes(tier_specs: tuple[str, ...]) -> int:
    """What the --kv-tier host:SIZE tiers may hold, in all (host memory, after the load)."""
    specs = [parse_tier_spec(text) for text in tier_specs]
    return sum(spec.size_bytes for spec in specs if spec.kind == "host")


def plan_all_weights(
    model: ModelConfig, model_dir: Path, arch: ArchConfig, device: torch.device
) -> WeightPlan:
    """The prefill weights, plus the decode-phase set where the formats are phase-aware."""
    return loads_weights(plan_loads(model, model_dir, arch, device))


def loads_weights(loads: ModelLoads) -> WeightPlan:
    weights = planned_weights(loads.model)
    return weights if loads.decode_model is None else weights + planned_weights(loads.decode_model)


# ---- what is available -------------------------------------------------------------------------
@dataclass(frozen=True)
class Available:
    num_bytes: int
    source: str  # "MemAvailable" or "the cgroup limit"


def available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")
) -> Available:
    """MemAvailable, or what the cgroup (v2) limit leaves, whichever is smaller."""
    found = Available(_meminfo_available(meminfo), "MemAvailable")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return found
    if limit == "max":
        return found
    left = max(int(limit) - used, 0)
    return Available(left, "the cgroup limit") if left < found.num_bytes else found


def _meminfo_available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    raise ModelLoadError(f"{meminfo} has no MemAvailable line; pass --skip-memory-check")


# ---- the check ---------------------------------------------------------------------------------
def check_memory(
    config: EngineConfig,
    model_dir: Path,
    arch: ArchConfig,
    kv_format: KVFormat,
    available: Callable[[], Available] = available_memory,
    fit_context: bool = False,
    weights: WeightPlan | None = None,
) -> MemoryPlan | None:
    """Refuse (ModelLoadError, one line) before loading when the plan cannot fit; the plan
    otherwise (None when skipped: --skip-memory-check, DENSA_SKIP_MEMORY_CHECK=1, not a CPU)."""
    skip = config.skip_memory_check or os.environ.get(SKIP_ENV) == "1"
    if skip or config.device.device != "cpu":
        return None
    free = available()
    plan = plan_memory(config, model_dir, arch, kv_format, free.num_bytes, fit_context, weights)
    if plan.needed_bytes > free.num_bytes:
        fits = "; ".join(would_fit(config, model_dir, arch, kv_format, plan, free))
        raise ModelLoadError(
            f"not enough memory: serving this model needs ~{format_bytes(plan.needed_bytes)} "
            f"({plan.describe()}) but {format_bytes(free.num_bytes)} is available "
            f"({free.source}); {fits or _NOTHING_FITS}; --skip-memory-check to start anyway"
        )
    return plan


def would_fit(
    config: EngineConfig,
    model_dir: Path,
    arch: ArchConfig,
    kv_format: KVFormat,
    plan: MemoryPlan,
    free: Available,
) -> list[str]:
    """The options that would fit, each with what it changes: a smaller fixed KV cache, a
    shorter --max-model-len (what one request needs is the floor of any KV cache), 4-bit
    weights."""
    fits = []
    cache, model, max_len = config.cache, config.model, config.model.max_model_len
    page = page_bytes(arch, cache.page_size, kv_format)
    w = plan.weights
    left = free.num_bytes - w.resident_bytes - plan.runtime_bytes  # for KV + activations
    kv_room = (left - plan.activation_bytes) // _MiB * _MiB
    if left >= w.transient_bytes:
        if not is_relative(cache) and kv_room >= _one_request_bytes(config, page):
            fits.append(f"--kv-cache-memory {kv_room // _MiB}MiB")
        tokens = max(kv_room, 0) // page * cache.page_size
        if cache.page_size <= tokens < max_len:
            fits.append(f"--max-model-len {tokens} (with a KV cache of that many tokens)")
    w4a8 = LinearFormat.W4A8  # the 4-bit format the CPU kernels run, offered when not asked
    if LinearFormat.of(model.weight_format) is not w4a8 and native.is_available():
        device = torch.device(config.device.device)
        w4 = plan_weights(model_dir, arch, model.dtype, max_len, device, w4a8, model.head_format)
        kv = _one_request_bytes(config, page) if is_relative(cache) else plan.kv_bytes
        if MemoryPlan(w4, kv, plan.activation_bytes).needed_bytes <= free.num_bytes:
            fits.append(f"--weight-format {w4a8} (weights {format_bytes(w4.resident_bytes)})")
    return fits


def _one_request_bytes(config: EngineConfig, page: int) -> int:
    return -(-config.model.max_model_len // config.cache.page_size) * page
