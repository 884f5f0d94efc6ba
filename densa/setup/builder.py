"""Building an engine from its options: options -> frozen config -> parts. Load the model(s) and
tokenizer, check the formats can run here, size the KV cache from its memory budget, and wire
the model runner; each helper gets only its own sub-config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from densa.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from densa.formats.kv_format import KVFormat
from densa.kernels.cpu import native
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.attention import AttentionBackend, LayerKVCache
from densa.model.attention_backends import select_backend
from densa.model.fused_decode import enable_fused_decode as enable_fused
from densa.model.fused_decode import unsupported_reason
from densa.model.interface import CausalLM
from densa.model.kv_layout import LayerCache
from densa.model.kv_pages import allocate_kv_caches, page_bytes
from densa.model.loader import auto_dtype, auto_formats, resolve_model_dir
from densa.sched.stop import StopRule
from densa.setup.args import EngineArgs, default_model_path
from densa.setup.kv_sizing import (
    KVBudget,
    draft_kv_page_bytes,
    fit_max_model_len,
    is_relative,
    resolve_num_pages,
)
from densa.setup.loading import load_models, load_static_kv_scales, load_tokenizer, plan_loads
from densa.setup.memory_plan import check_memory, loads_weights
from densa.setup.proposers import DraftTarget, build_proposer, streamed_weight_bytes
from densa.spec.proposer import Proposer
from densa.text.tokenizer import Tokenizer
from densa.utils.heap import return_free_heap
from densa.utils.logging import get_logger
from densa.utils.sizes import format_bytes
from densa.worker.cuda_graphs import DEFAULT_BATCH_SIZES, DecodeGraphs
from densa.worker.grammar import GrammarCompiler
from densa.worker.integrity import IntegrityChecker, NoopIntegrityChecker, TagTableChecker
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


@dataclass(frozen=True)
class ModelSource:
    """The checkpoint an engine serves, and its options frozen against it (KV not sized yet)."""

    config: EngineConfig  # cache.num_pages 0 and no eos tokens until `EngineConfig.sized`
    model_dir: Path
    arch: ArchConfig
    kv_format: KVFormat  # KVFormat.of_cache(config.cache): sizing and allocation take it


def _refuse_hybrid(arch: ArchConfig) -> None:
    """Hybrid models (Gated DeltaNet layers) run in densa's model layer, but the engine does not
    yet give each request a state slot (issue 40, point 2): refuse before any loading."""
    if arch.linear is not None:
        raise ModelLoadError(
            f"{arch.architecture} is a hybrid model (linear-attention layers with per-request "
            "state); densa's engine cannot serve it yet: the state slots in the memory manager "
            "are not built (issue 40)"
        )


def build_engine_parts(args: EngineArgs) -> EngineParts:
    args.check()
    source = locate_model(_without_prefix_caching_for_mtp(args))
    config, arch, kv_format = source.config, source.arch, source.kv_format
    _refuse_hybrid(arch)
    device = torch.device(config.device.device)
    static_scales = load_static_kv_scales(config.cache, kv_format, arch, device)  # fails fast
    fit = args.max_model_len is None  # the trained context, shortened to what the KV holds
    # A fixed size is checked before the slow load; a share of free memory only after it.
    sized = None if is_relative(config.cache) else _num_pages(config, arch, kv_format, device, fit)
    loads = plan_loads(config.model, source.model_dir, arch, device)  # measured, then loaded
    check_memory(config, source.model_dir, arch, kv_format, fit_context=fit,
                 weights=loads_weights(loads))  # or refuses  # fmt: skip
    logger.info("loading the model %s", config.model.model)
    tokenizer = load_tokenizer(source.model_dir, arch.eos_token_ids)
    _release(tokenizer)  # before the weights arrive: the load's peak does not hold it either
    model, decode_model = load_models(loads)
    num_pages, budget = sized or _num_pages(config, arch, kv_format, device, fit)
    config = config.sized(num_pages, tokenizer.eos_token_ids)
    if fit:
        config = _fitted_context(config)
    kv_caches = allocate_kv_caches(
        arch, num_pages, config.cache.page_size, kv_format, device, static_scales
    )
    backend = select_backend(config.device.attention_backend, device)
    _log_kv_cache(config, arch, kv_format, budget, backend)
    target = DraftTarget(
        config.model, config.cache, device, arch, tokenizer, backend, kv_format,
        streamed_weight_bytes(model),
    )  # fmt: skip
    proposer = build_proposer(config.speculative, target)
    # What the proposer needs of the runner (an MTP layer: every position's hidden state).
    keeps_hidden = proposer is not None and proposer.needs_hidden_states
    runner = build_runner(
        config, model, decode_model, kv_caches, backend, tokenizer, arch, keeps_hidden
    )
    _release(tokenizer)  # a draft model's check may have rebuilt it
    described = kv_format.describe()
    return EngineParts(config, tokenizer, runner, arch, described, model.weight_format, proposer)


def _release(tokenizer: Tokenizer) -> None:
    """The engine keeps only what the tokenizer said at load (EOS ids, vocabulary size) and the
    files it hands to fronts; its Rust tokenizer (~60 MB for 150k tokens, plus what parsing left
    in the heap) is rebuilt only if something asks it to encode or decode (the offline API)."""
    if tokenizer.is_loaded:
        tokenizer.release()
        return_free_heap()


def locate_model(args: EngineArgs) -> ModelSource:
    """The checkpoint, its architecture, and the options resolved against it ("auto" formats
    and dtype as the checkpoint stores them, the context length within the model's)."""
    model_path = args.model or default_model_path()
    model_dir = resolve_model_dir(model_path)
    weights, head = auto_formats(model_path, model_dir, args.weight_format, args.head_format)
    dtype = auto_dtype(model_path, model_dir, args.dtype)
    args = dataclasses.replace(args, weight_format=weights, head_format=head, dtype=dtype)
    arch = ArchConfig.from_dir(model_dir)
    config = args.resolve(arch, model_path)
    # The one KVFormat, read back from the frozen config (its index key dtype included) and
    # passed down from here: sizing, the memory plan, allocation, proposers, the handshake.
    return ModelSource(config, model_dir, arch, KVFormat.of_cache(config.cache))


def _num_pages(
    config: EngineConfig,
    arch: ArchConfig,
    kv_format: KVFormat,
    device: torch.device,
    fit: bool = False,
) -> tuple[int, KVBudget]:
    draft_page = draft_kv_page_bytes(config.speculative, config.cache.page_size, kv_format)
    return resolve_num_pages(
        config.cache, config.scheduler, arch, kv_format, device, draft_page, fit
    )


def _fitted_context(config: EngineConfig) -> EngineConfig:
    """The default max_model_len: the model's trained context if one request of it fits in the
    KV pages, else the most they hold (said in the log either way, as llama.cpp's --fit)."""
    trained, cache = config.scheduler.max_model_len, config.cache
    max_len = fit_max_model_len(trained, cache.num_pages, cache.page_size)
    if max_len == trained:
        logger.info("max_model_len %d: the model's trained context", trained)
        return config
    logger.warning(
        "max_model_len %d: the most the KV cache holds (%d pages x %d tokens); the model's "
        "trained context is %d: raise --kv-cache-memory for it, or set --max-model-len",
        max_len, cache.num_pages, cache.page_size, trained,
    )  # fmt: skip
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, max_model_len=max_len),
        scheduler=dataclasses.replace(config.scheduler, max_model_len=max_len),
    )


def build_runner(
    config: EngineConfig,
    model: CausalLM,
    decode_model: CausalLM | None,
    kv_caches: list[LayerCache],
    backend: AttentionBackend,
    tokenizer: Tokenizer,
    arch: ArchConfig,
    keeps_hidden: bool = False,
) -> ModelRunner:
    """The model runner over the allocated KV pages, with its integrity checker and graphs;
    `keeps_hidden`: every computed position's hidden state is kept for the proposer."""
    device = torch.device(config.device.device)
    # The fused step attends in C++ for decodes: with another backend asked for by name (torch,
    # triton), that backend is what runs.
    fused: list[bool] = []  # per weight set: whether its decode-only steps run fused
    deterministic = config.device.deterministic
    if config.device.fused_decode and backend.capabilities.fused_decode:
        fused = [
            enable_fused_decode(w, kv_caches, deterministic)
            for w in (model, decode_model)
            if w is not None
        ]
    if deterministic and not (fused and all(fused)):
        raise ValueError(deterministic_refusal(config, backend, model, kv_caches))
    graphs = build_decode_graphs(
        config.device, config.cache, config.scheduler, decode_model or model, kv_caches, backend
    )
    return ModelRunner(
        model,
        kv_caches,
        config.cache.page_size,
        backend,
        StopRule.of(config.scheduler),
        device,
        make_integrity_checker(config.cache, device, backend),
        config.model.seed,
        decode_model=decode_model,
        decode_graphs=graphs,
        grammars=GrammarCompiler(tokenizer, arch.vocab_size),
        decodes_apart=any(fused),
        keeps_hidden=keeps_hidden,
    )


def _log_kv_cache(
    config: EngineConfig,
    arch: ArchConfig,
    kv_format: KVFormat,
    budget: KVBudget,
    backend: AttentionBackend,
) -> None:
    cache = config.cache
    kv_bytes = cache.num_pages * page_bytes(arch, cache.page_size, kv_format)
    logger.info(
        "KV cache: %d pages x %d tokens = %d tokens (%s, %s: %s), max_model_len %d, "
        "max_num_seqs %d, attention backend %s",
        cache.num_pages, cache.page_size, cache.num_pages * cache.page_size,
        kv_format.describe(), format_bytes(kv_bytes), budget.reason,
        config.scheduler.max_model_len, config.scheduler.max_num_seqs, backend.name,
    )  # fmt: skip


def deterministic_refusal(
    config: EngineConfig, backend: AttentionBackend, model: CausalLM, kv_caches: list[LayerCache]
) -> str:
    """Why --deterministic cannot run here: it is the fused C++ step's row-by-row attention."""
    if not config.device.fused_decode:
        why = "--no-fused-decode was given"
    elif not backend.capabilities.fused_decode:
        why = f"the {backend.name!r} attention backend is not the CPU's"
    else:
        why = unsupported_reason(model, kv_caches) or "the decode model's weights cannot run it"
    return (
        f"--deterministic needs the fused C++ CPU step, which cannot run here: {why} "
        "(docs/architecture.md, 'Deterministic mode')"
    )


def enable_fused_decode(
    model: CausalLM, kv_caches: list[LayerCache], deterministic: bool = False
) -> bool:
    """Decode-only steps of `model` run through the fused C++ step, if it can run them (True)."""
    reason = enable_fused(model, kv_caches, deterministic)
    if reason is not None:
        logger.info("fused decode off: %s; eager steps", reason)
        return False
    logger.info("fused decode on (%s code path)", native.isa())
    return True


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
    device: DeviceConfig,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    model: CausalLM,
    kv_caches: list[LayerCache],
    backend: AttentionBackend,
) -> DecodeGraphs | None:
    """CUDA graphs of decode steps, on a GPU with a graph-safe backend (else None: eager).
    Latent (MLA) pages have no graph-safe kernel yet, so those models decode eagerly."""
    graph_safe = backend.capabilities.supports_cuda_graphs
    if device.device == "cpu" or not device.cuda_graphs or not graph_safe:
        return None
    layer_caches = [c for c in kv_caches if isinstance(c, LayerKVCache)]
    if len(layer_caches) != len(kv_caches):
        logger.info("CUDA graphs off: latent KV pages decode eagerly")
        return None
    max_num_seqs, page_size = scheduler.max_num_seqs, cache.page_size
    sizes = [s for s in DEFAULT_BATCH_SIZES if s <= max_num_seqs] or [max_num_seqs]
    graphs = DecodeGraphs(
        model, layer_caches, backend, page_size, -(-scheduler.max_model_len // page_size),
        torch.device(device.device), sizes,
    )  # fmt: skip
    logger.info("CUDA graphs captured for decode batch sizes %s", sizes)
    return graphs


def _without_prefix_caching_for_mtp(args: EngineArgs) -> EngineArgs:
    """The MTP layer needs the target's hidden state of every position, and a prefix hit skips
    computing them: with MTP, prompts are computed whole (prefix caching off)."""
    config = args.speculative_config()
    if config is None or config.method != "mtp" or not args.enable_prefix_caching:
        return args
    logger.info("prefix caching off: the MTP proposer reads every position's hidden state")
    return dataclasses.replace(args, enable_prefix_caching=False)
