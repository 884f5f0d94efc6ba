"""Building an engine from its options: load the model(s) and tokenizer, check the formats can
run here, size the KV cache from its memory budget, and wire the model runner."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from densa.config import CacheConfig, EngineConfig, SpeculativeConfig
from densa.engine.args import AUTO_KV_MAX_FRACTION, EngineArgs, default_model_path
from densa.engine.memory_plan import check_memory
from densa.formats import fp8_kv
from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import native
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention import AttentionBackend, LayerKVCache
from densa.model.attention_backends import select_backend
from densa.model.fused_decode import enable_fused_decode as enable_fused
from densa.model.interface import CausalLM
from densa.model.kv_layout import LayerCache
from densa.model.linear import resident_weight_bytes
from densa.model.loader import auto_dtype, auto_formats, load_model, resolve_model_dir
from densa.model.packed_linear import PACKED_FORMATS
from densa.sched.stop import StopRule
from densa.spec.draft import DraftModelProposer, DraftSpec, draft_page_bytes, load_draft_proposer
from densa.spec.mtp import MTPProposer, load_mtp_proposer
from densa.spec.ngram import NgramProposer
from densa.spec.proposer import Proposer
from densa.text.tokenizer import Tokenizer, TokenizerLoadError
from densa.utils.logging import get_logger
from densa.utils.sizes import format_bytes
from densa.worker.cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphs
from densa.worker.grammar import GrammarCompiler
from densa.worker.integrity import IntegrityChecker, NoopIntegrityChecker, TagTableChecker
from densa.worker.kv_cache import allocate_kv_caches, page_bytes
from densa.worker.model_runner import ModelRunner

logger = get_logger(__name__)


@dataclass(frozen=True)
class EngineParts:
    config: EngineConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    arch: ArchConfig
    kv_format: str  # e.g. "fp8_e4m3, dynamic scales"
    weight_format: str  # e.g. "dense", "int4 g128 symmetric"
    proposer: Proposer | None = None  # speculative decoding's (None: off)


def build_engine_parts(args: EngineArgs) -> EngineParts:
    args.check()
    args = _without_prefix_caching_for_mtp(args)
    model_path = args.model or default_model_path()
    model_dir = resolve_model_dir(model_path)
    weights, head = auto_formats(model_path, model_dir, args.weight_format, args.head_format)
    dtype = auto_dtype(model_path, model_dir, args.dtype)
    args = dataclasses.replace(args, weight_format=weights, head_format=head, dtype=dtype)
    arch = ArchConfig.from_dir(model_dir)
    device = torch.device(args.device)
    max_len = args.resolved_max_model_len(arch)
    kv_format = args.kv_format()  # resolved once: sizing, allocation and the config use it
    kv_dtype, kv_scales = kv_format.name, kv_format.fp8_policy
    static_scales = load_static_kv_scales(args, kv_format, arch, device)  # fails fast
    # A fixed size is checked before the slow load; a share of free memory only after it.
    sized = (
        None if _is_relative(args) else _resolve_num_pages(args, arch, kv_format, max_len, device)
    )
    check_memory(args, model_dir, arch, kv_format, max_len)  # refuses what cannot fit
    logger.info("loading the model %s", model_path)
    tokenizer = load_tokenizer(model_dir, arch.eos_token_ids)
    model = load_model(
        model_dir, arch, args.dtype, max_len, device, args.weight_format, args.head_format
    )
    decode_model = load_decode_model(args, arch, model_dir, max_len, device)
    num_pages, budget = sized or _resolve_num_pages(args, arch, kv_format, max_len, device)
    config = args.resolve(arch, model_path, num_pages, tokenizer.eos_token_ids, kv_format)
    kv_caches = allocate_kv_caches(
        arch, num_pages, args.page_size, kv_dtype, device, kv_scales, static_scales
    )
    backend = select_backend(args.attention_backend, device)
    # The fused step attends in C++ for decodes: with another backend asked for by name (torch,
    # triton), that backend is what runs.
    fused: list[bool] = []  # per weight set: whether its decode-only steps run fused
    if args.fused_decode and backend.capabilities.fused_decode:
        fused = [enable_fused_decode(w, kv_caches) for w in (model, decode_model) if w is not None]
    runner = ModelRunner(
        model,
        kv_caches,
        args.page_size,
        backend,
        StopRule.of(config.scheduler),
        device,
        make_integrity_checker(config.cache, device, backend),
        args.seed,
        decode_model=decode_model,
        decode_graphs=build_decode_graphs(args, decode_model or model, kv_caches, backend, max_len),
        grammars=GrammarCompiler(tokenizer, arch.vocab_size),
        decodes_apart=any(fused),
    )
    logger.info(
        "KV cache: %d pages x %d tokens = %d tokens (%s, %s: %s), max_model_len %d, "
        "max_num_seqs %d, attention backend %s",
        num_pages, args.page_size, num_pages * args.page_size,
        kv_format.describe(),
        format_bytes(num_pages * page_bytes(arch, args.page_size, kv_dtype, kv_scales)),
        budget.reason, max_len, args.max_num_seqs, backend.name,
    )  # fmt: skip
    described = kv_format.describe()
    proposer = build_proposer(
        config.speculative,
        DraftTarget(args, arch, tokenizer, backend, num_pages, max_len, kv_format),
    )
    # The MTP layer reads the target's final hidden state of every position it caches.
    runner.keeps_hidden = isinstance(proposer, MTPProposer)
    return EngineParts(config, tokenizer, runner, arch, described, model.weight_format, proposer)


@dataclass(frozen=True)
class DraftTarget:
    """What a draft proposer is built next to: the target's options, model and KV geometry."""

    args: EngineArgs
    arch: ArchConfig
    tokenizer: Tokenizer
    backend: AttentionBackend
    num_pages: int  # the target's KV pages
    max_len: int
    kv_format: KVFormat


def build_proposer(config: SpeculativeConfig | None, target: DraftTarget) -> Proposer | None:
    """The proposer of speculative tokens the config names (docs/speculative.md)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer()
    if config.method == "draft" and config.model is not None:
        return build_draft_proposer(config.model, config.num_tokens, target)
    if config.method == "mtp":
        args = target.args
        return load_mtp_proposer(
            resolve_model_dir(args.model or default_model_path()), target.arch, args.dtype,
            target.num_pages, args.page_size, target.backend, torch.device(args.device),
            target.max_len + config.num_tokens,
        )  # fmt: skip
    raise ValueError(f"speculative method {config.method!r} is not available in this build")


def build_draft_proposer(model: str, num_tokens: int, target: DraftTarget) -> DraftModelProposer:
    """The draft model with as many KV pages as the target has (same page size): every token the
    target holds can have its draft counterpart, so the draft never runs out first. Its bytes
    come out of the same KV budget (see `kv_page_bytes`); its KV format is the target's."""
    args, kv_format = target.args, target.kv_format
    spec = DraftSpec(
        model, args.page_size, target.num_pages, target.max_len + num_tokens, args.dtype,
        weight_format=args.weight_format if args.weight_format in PACKED_FORMATS else "auto",
        kv_cache_dtype=kv_format.name,
    )  # fmt: skip
    device = torch.device(args.device)
    return load_draft_proposer(spec, target.arch, target.tokenizer, target.backend, device)


def enable_fused_decode(model: CausalLM, kv_caches: list[LayerCache]) -> bool:
    """Decode-only steps of `model` run through the fused C++ step, if it can run them (True)."""
    reason = enable_fused(model, kv_caches)
    if reason is not None:
        logger.info("fused decode off: %s; eager steps", reason)
        return False
    logger.info("fused decode on (%s code path)", native.isa())
    return True


def load_tokenizer(model_dir: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer:
    try:
        return Tokenizer.from_dir(model_dir, eos_token_ids)
    except (TokenizerLoadError, OSError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc


def make_integrity_checker(
    cache: CacheConfig, device: torch.device, backend: AttentionBackend | None = None
) -> IntegrityChecker:
    """The tag table lives next to the KV pages; the Triton backend brings its one-kernel check."""
    if not cache.kv_integrity:
        return NoopIntegrityChecker()
    # A fresh pool's tags are page ids (generation 0); the pool reports every change after that.
    initial_tags = list(range(cache.num_pages))
    if backend is not None and backend.capabilities.batched_tag_check:
        from densa.worker.integrity import TritonTagTableChecker

        return TritonTagTableChecker(initial_tags, cache.page_size, device)
    return TagTableChecker(initial_tags, cache.page_size, device)


def build_decode_graphs(
    args: EngineArgs,
    model: CausalLM,
    kv_caches: list[LayerCache],
    backend: AttentionBackend,
    max_len: int,
) -> DecodeGraphs | None:
    """CUDA graphs of decode steps, on a GPU with a graph-safe backend (else None: eager).
    Latent (MLA) pages have no graph-safe kernel yet, so those models decode eagerly."""
    graph_safe = backend.capabilities.supports_cuda_graphs
    if args.device == "cpu" or not args.cuda_graphs or not graph_safe:
        return None
    layer_caches = [c for c in kv_caches if isinstance(c, LayerKVCache)]
    if len(layer_caches) != len(kv_caches):
        logger.info("CUDA graphs off: latent KV pages decode eagerly")
        return None
    sizes = [s for s in DEFAULT_BATCH_SIZES if s <= args.max_num_seqs] or [args.max_num_seqs]
    graphs = DecodeGraphs(
        model, layer_caches, backend, args.page_size, -(-max_len // args.page_size),
        torch.device(args.device), sizes,
    )  # fmt: skip
    logger.info("CUDA graphs captured for decode batch sizes %s", sizes)
    return graphs


def load_decode_model(
    args: EngineArgs, arch: ArchConfig, model_dir: Path, max_len: int, device: torch.device
) -> CausalLM | None:
    """The decode-phase weight set (phase-aware formats), or None when decode shares `model`'s.

    It must be the same model (same shapes): its layers write into and read from the same KV
    cache as the prefill weights'. Costs its resident weight bytes on top of the prefill set's.
    """
    if args.decode_weight_format is not None:
        model = load_model(
            model_dir, arch, args.dtype, max_len, device, args.decode_weight_format,
            args.head_format,
        )  # fmt: skip
        logger.info(
            "phase-aware weights: decode runs through a %s copy (%s more resident memory)",
            args.decode_weight_format, format_bytes(resident_weight_bytes(model)),
        )  # fmt: skip
        return model
    if args.decode_model is None:
        return None
    decode_dir = resolve_model_dir(args.decode_model)
    decode_arch = ArchConfig.from_dir(decode_dir)
    if not same_shapes(arch, decode_arch):
        raise ModelLoadError(
            f"--decode-model {args.decode_model} is not the same model as --model "
            "(its layer shapes differ); it must be a checkpoint of the same weights"
        )
    model = load_model(
        decode_dir, decode_arch, args.dtype, max_len, device, "auto", args.head_format
    )
    logger.info(
        "phase-aware weights: decode runs through %s (%s more resident weight memory)",
        decode_dir.name, format_bytes(resident_weight_bytes(model)),
    )  # fmt: skip
    return model


def same_shapes(a: ArchConfig, b: ArchConfig) -> bool:
    """Whether two checkpoints can share one KV cache and one tokenizer."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings")  # fmt: skip
    return all(getattr(a, key) == getattr(b, key) for key in keys)


def load_static_kv_scales(
    args: EngineArgs, kv_format: KVFormat, arch: ArchConfig, device: torch.device
) -> fp8_kv.KVScales | None:
    """Check an FP8 KV cache can run here; the static scales it uses (None: not needed).

    Raises ModelLoadError naming the alternative when this build cannot run FP8, and when the
    scales file does not fit the model. Options that do not fit together raise ValueError.
    """
    if not kv_format.is_fp8:
        return None
    problem = fp8_kv.fp8_support_error(device)
    if problem is not None:
        raise ModelLoadError(problem)
    scales = kv_format.scales
    if args.kv_scales_file is not None and scales != "static":
        raise ValueError("a KV scales file holds static per-layer scales: use --kv-scales static")
    if scales != "static":
        return None
    if args.kv_scales_file is None:
        return fp8_kv.KVScales.ones(arch.num_layers)
    try:
        return fp8_kv.KVScales.load(args.kv_scales_file, arch.num_layers)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


@dataclass(frozen=True)
class KVBudget:
    num_bytes: int
    reason: str  # how it was chosen, for the start-up log


def kv_budget(
    args: EngineArgs, arch: ArchConfig, kv_format: KVFormat, device: torch.device
) -> KVBudget:
    """The KV cache's byte budget, and why (an explicit size, a share of free memory, or auto)."""
    page = page_bytes(arch, args.page_size, kv_format.name, kv_format.fp8_policy)
    if args.num_kv_pages is not None:
        return KVBudget(args.num_kv_pages * page, f"--num-kv-pages {args.num_kv_pages}")
    free = _free_memory(device)
    budget = args.kv_budget()
    if isinstance(budget, int):
        if budget > free:
            raise ModelLoadError(
                f"--kv-cache-memory {args.kv_cache_memory} is more than the "
                f"{format_bytes(free)} of memory free; lower it"
            )
        return KVBudget(budget, f"--kv-cache-memory {args.kv_cache_memory}")
    if isinstance(budget, float):
        return KVBudget(int(free * budget), f"{budget:.0%} of {format_bytes(free)} free")
    max_len = args.resolved_max_model_len(arch)
    wanted = args.max_num_seqs * -(-max_len // args.page_size) * page
    cap = int(free * AUTO_KV_MAX_FRACTION)
    reason = f"room for {args.max_num_seqs} requests x {max_len} tokens"
    if wanted > cap:
        reason += f", capped at {AUTO_KV_MAX_FRACTION:.0%} of {format_bytes(free)} free"
    return KVBudget(min(wanted, cap), reason)


def _is_relative(args: EngineArgs) -> bool:
    """Whether the KV budget depends on the memory left once the weights are loaded."""
    return args.num_kv_pages is None and not isinstance(args.kv_budget(), int)


def _free_memory(device: torch.device) -> int:
    if device.type == "cpu":
        return int(psutil.virtual_memory().available)
    return int(torch.cuda.mem_get_info(device)[0])


def _resolve_num_pages(
    args: EngineArgs, arch: ArchConfig, kv_format: KVFormat, max_len: int, device: torch.device
) -> tuple[int, KVBudget]:
    """The target's KV pages. A draft model gets as many pages of its own, out of the same budget:
    a share of memory buys pages of (target + draft) bytes; an exact --num-kv-pages is the
    target's, the draft's pages coming on top."""
    budget = kv_budget(args, arch, kv_format, device)
    target_page = page_bytes(arch, args.page_size, kv_format.name, kv_format.fp8_policy)
    draft_page = _draft_page_bytes(args, kv_format)
    if args.num_kv_pages is not None:
        num_pages = args.num_kv_pages
    else:
        num_pages = budget.num_bytes // (target_page + draft_page)
    if draft_page:
        budget = dataclasses.replace(
            budget, reason=f"{budget.reason}; a draft model takes {format_bytes(draft_page)}/page"
        )
    needed = -(-max_len // args.page_size)
    if num_pages < needed:
        raise ModelLoadError(
            f"the KV cache budget ({format_bytes(budget.num_bytes)}, {budget.reason}) holds "
            f"{num_pages} pages but one {max_len}-token request needs {needed}; "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    return num_pages, budget


def _draft_page_bytes(args: EngineArgs, kv_format: KVFormat) -> int:
    """Bytes of one page of the draft model's KV (0 without a draft model)."""
    config = args.speculative_config()
    if config is None or config.method != "draft" or config.model is None:
        return 0
    return draft_page_bytes(config.model, args.page_size, kv_format.name)


def _without_prefix_caching_for_mtp(args: EngineArgs) -> EngineArgs:
    """The MTP layer needs the target's hidden state of every position, and a prefix hit skips
    computing them: with MTP, prompts are computed whole (prefix caching off)."""
    config = args.speculative_config()
    if config is None or config.method != "mtp" or not args.enable_prefix_caching:
        return args
    logger.info("prefix caching off: the MTP proposer reads every position's hidden state")
    return dataclasses.replace(args, enable_prefix_caching=False)
