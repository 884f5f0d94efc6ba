"""Find a checkpoint (HF directory or GGUF file), check it fits, build the model, load weights.

Weight formats: a checkpoint says in its safetensors metadata whether (and how) its linear
weights are quantized (`densa.quant.weight_format`); the loader never guesses from names. The
runtime format is what the checkpoint stores ("auto"), dense ("dense": dequantized at load), or
a quantized format applied at load time by round-to-nearest ("int4", "fp8"; for checkpoints
stored dense -- `densa quantize` writes the calibrated ones).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from densa.kernels.cpu import native
from densa.memory import rehome_on_huge_pages
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.checkpoint_files import iter_checkpoint, read_stored_format, safetensors_files
from densa.model.gguf import GGUFFile, ensure_converted, stored_quantization
from densa.model.gguf_loading import (
    BlockSink,
    KeptEmbedding,
    KeptLinear,
    dequantized_message,
    dequantized_types,
    gguf_checkpoint,
    plan_kept_embedding,
    plan_kept_linears,
    swap_kept_embedding,
    swap_kept_linears,
)
from densa.model.interface import CausalLM
from densa.model.key_centering import center_keys
from densa.model.linear import prepare_quantized, resident_weight_bytes
from densa.model.packed_linear import PackedFormatUnavailable, pack_linears
from densa.model.quant_targets import OUTPUT_HEAD
from densa.model.quantized_embedding import GGUFEmbedding
from densa.model.registry import meta_skeleton, model_factory
from densa.model.runtime_weights import (
    quantizable_linears,
    quantized_modules,
    runtime_format,
    runtime_tensors,
    swap_quantized,
)
from densa.model.stacked_linear import prepare_stacked
from densa.quant import gguf_blocks
from densa.quant.linear_format import HeadFormat, LinearFormat
from densa.quant.weight_format import CheckpointFormat, WeightFormat
from densa.utils.heap import keep_large_allocations_unmappable, return_free_heap
from densa.utils.logging import get_logger
from densa.utils.sizes import format_bytes

logger = get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(model: str) -> Path:
    """A directory with config.json, converting a .gguf file on first use."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {model!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(
                f"{model!r} is a file but not a .gguf; pass a GGUF file or an HF directory"
            )
        return ensure_converted(path)
    return path


def num_parameters(model: torch.nn.Module) -> int:
    """Parameters of a (meta-device) model, tied ones counted once."""
    return sum(p.numel() for p in model.parameters())


def _meta_bytes(model: torch.nn.Module) -> int:
    """Bytes of a meta-device model's parameters and buffers, each tensor once."""
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in unique.values())


def check_fits(
    num_params: int, dtype: torch.dtype, device: torch.device, packed_savings: int = 0
) -> int:
    """Bytes the weights need (less what packed layers save); refuse early if the machine
    clearly cannot hold them."""
    needed = num_params * dtype.itemsize - packed_savings
    if device.type == "cpu":
        available = psutil.virtual_memory().available
    else:
        available = torch.cuda.mem_get_info(device)[0]
    if needed > available:
        raise ModelLoadError(
            f"the weights need {format_bytes(needed)} in {dtype} but only "
            f"{format_bytes(available)} is free; pick a smaller dtype or model, or free memory"
        )
    return needed


@dataclass
class LoadPlan:
    """What `load_model` builds, decided once from the checkpoint's headers (no tensor read):
    the model on the meta device with every layer swapped for the format it runs in, and where
    its weights come from. The memory check measures it, `load_planned` fills it (once: the
    meta model becomes the loaded one)."""

    model_dir: Path
    model: CausalLM  # on the meta device, tied
    dtype: str
    device: torch.device
    weight_format: LinearFormat
    head_format: HeadFormat
    source: GGUFFile | None  # a converted GGUF file, read from the file itself
    files: list[Path]  # else the safetensors files
    stored: CheckpointFormat | None  # what the checkpoint says it stores
    runtime: WeightFormat | None  # what the quantized layers run as
    targets: set[str]  # the layers `runtime` quantizes
    kept: dict[str, KeptLinear]  # the GGUF layers kept in their blocks
    table: KeptEmbedding | None  # the GGUF embedding kept in its blocks
    num_params: int
    packed_savings: int  # bytes the formats save against dense weights of `dtype`

    @property
    def packed(self) -> str | None:
        """The CPU kernels' format the linears are packed into after the load (None: not)."""
        return self.weight_format.packed


def plan_load(
    model_dir: Path,
    arch: ArchConfig,
    dtype: str,
    max_position: int,
    device: torch.device,
    weight_format: str | LinearFormat = LinearFormat.AUTO,
    head_format: str | HeadFormat = HeadFormat.DENSE,
) -> LoadPlan:
    """The load of `model_dir` in the runtime format `weight_format` selects, planned."""
    fmt = LinearFormat.of(weight_format)  # an option value as given (tests, benchmarks)
    head = _resolved_head(head_format)
    torch_dtype = DTYPES[dtype]
    source = GGUFFile.of_converted(model_dir)
    files = [] if source is not None else safetensors_files(model_dir)
    stored = read_stored_format(files) if files else None
    runtime = runtime_format(stored, fmt)
    with meta_skeleton():
        model = model_factory(arch.architecture)(arch, max_position, device).to(dtype=torch_dtype)
        num_params = num_parameters(model)
        kept = kept_linears(model, source, fmt, head, device)
        table = kept_embedding(model, source, arch, device)
        targets = quantized_modules(model, stored, runtime)
        if runtime is not None:
            swap_quantized(model, targets, runtime)
        # What the quantized layers (INT4, FP8, FP4) hold less than dense ones, and the GGUF
        # layers kept in their blocks.
        savings = num_params * torch_dtype.itemsize - _meta_bytes(model)
        savings += _packed_savings(model, kept, table, torch_dtype)
        swap_kept_linears(model, kept)
        swap_kept_embedding(model, table)
        model.tie_weights()
    return LoadPlan(model_dir, model, dtype, device, fmt, head, source, files,
                    stored, runtime, targets, kept, table, num_params, savings)  # fmt: skip


def load_model(
    model_dir: Path,
    arch: ArchConfig,
    dtype: str,
    max_position: int,
    device: torch.device,
    weight_format: str | LinearFormat = LinearFormat.AUTO,
    head_format: str | HeadFormat = HeadFormat.DENSE,
) -> CausalLM:
    """Build the model and load its weights in the runtime format `weight_format` selects; the
    packed CPU formats (w4a8, w8a8) are made from the loaded dense weights, and `head_format`
    w8a8 packs the output head too (tied or not). A converted GGUF file is read from the file
    itself, its linear layers kept in their blocks where the kernels run them
    (densa.model.gguf_loading)."""
    plan = plan_load(model_dir, arch, dtype, max_position, device, weight_format, head_format)
    return load_planned(plan)


def load_planned(plan: LoadPlan) -> CausalLM:
    """Allocate the planned model and fill it from the checkpoint (a plan loads once)."""
    device, model_dir = plan.device, plan.model_dir
    check_fits(plan.num_params, DTYPES[plan.dtype], device, plan.packed_savings)
    keep_large_allocations_unmappable()  # the load's temporaries must not stay in the heap
    model = plan.model.to_empty(device=device)
    model.tie_weights()
    raw = (
        gguf_checkpoint(plan.source, model, BlockSink(model, plan.kept, plan.table))
        if plan.source is not None
        else iter_checkpoint(plan.files)
    )
    tensors = runtime_tensors(raw, model, plan.stored, plan.runtime, plan.targets)
    _load_weights(model, model_dir, tensors)
    prepare_quantized(model)
    _pack(model, plan.packed, plan.head_format)
    prepare_stacked(model)
    center_keys(model)
    model.weight_format = _describe_weights(plan.runtime, plan.packed, plan.head_format, plan.kept)
    if device.type == "cpu":
        rehome_on_huge_pages(model)  # streaming weights from huge pages is ~30% faster
        return_free_heap()
    logger.info(
        "loaded %s (%s parameters, %s compute, %s weights: %s resident)",
        model_dir.name, f"{plan.num_params:,}", plan.dtype, model.weight_format,
        format_bytes(resident_weight_bytes(model)),
    )  # fmt: skip
    return model.eval()


def _load_weights(
    model: CausalLM, model_dir: Path, tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    try:
        with torch.no_grad():
            model.load_weights(tensors)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"checkpoint in {model_dir} does not match its config: {exc}") from exc


def kept_linears(
    model: CausalLM,
    source: GGUFFile | None,
    weight_format: LinearFormat,
    head_format: HeadFormat,
    device: torch.device,
) -> dict[str, KeptLinear]:
    """The GGUF linear layers (and, with head format `blocks`, the output head) that keep
    their blocks (none without the C++ kernels); warns once naming the quantized types that
    load as float32 instead."""
    if source is None or device.type != "cpu" or not native.is_available():
        return {}
    targets = quantizable_linears(model, include_head=head_format.is_gguf_blocks)
    layouts = source.layouts()
    kept = plan_kept_linears(model, layouts, targets, weight_format)
    if head_format.is_gguf_blocks and OUTPUT_HEAD not in kept:
        head_only = plan_kept_linears(model, layouts, {OUTPUT_HEAD}, LinearFormat.BLOCKS)
        kept.update(head_only)  # the head's own family even when the linears were asked dense
    found = dequantized_types(model, layouts, targets, kept)
    message = dequantized_message(found, weight_format)
    if message is not None:
        logger.warning(message)
    return kept


def kept_embedding(
    model: CausalLM, source: GGUFFile | None, arch: ArchConfig, device: torch.device
) -> KeptEmbedding | None:
    """The token embedding kept in its GGUF blocks (CPU only: lookups decode on the host)."""
    if source is None or device.type != "cpu":
        return None
    return plan_kept_embedding(model, source.layouts(), arch.tie_word_embeddings)


def _packed_savings(
    model: CausalLM,
    kept: dict[str, KeptLinear],
    table: KeptEmbedding | None,
    dtype: torch.dtype,
) -> int:
    """Bytes the kept layers (and embedding) need less than dense weights of `dtype`."""
    saved = 0
    if table is not None:
        row_bytes = GGUFEmbedding.row_bytes(table.type_name, table.embedding_dim)
        dense = table.embedding_dim * dtype.itemsize
        saved += table.num_embeddings * (dense - row_bytes)
    for name, layer in kept.items():
        out_features, in_features = getattr(model.get_submodule(name), "weight").shape  # noqa: B009
        dense = out_features * in_features * dtype.itemsize
        saved += dense - layer.packed_bytes(in_features)
    return saved


def _pack(model: CausalLM, weight_format: str | None, head_format: HeadFormat) -> None:
    """Pack the linear layers (and the output head) into the CPU kernels' formats, if asked."""
    try:
        if weight_format is not None:
            skipped = pack_linears(model, quantizable_linears(model), weight_format)
            if skipped:
                logger.info("%d linear layers stay dense (shape does not tile)", len(skipped))
        head = head_format.packed
        if head is not None and pack_linears(model, {OUTPUT_HEAD}, head):
            raise ModelLoadError(f"the output head's shape does not fit {head}")
    except PackedFormatUnavailable as exc:
        raise ModelLoadError(str(exc)) from exc


def _describe_weights(
    runtime: WeightFormat | None, packed: str | None, head: HeadFormat, kept: dict[str, KeptLinear]
) -> str:
    linear = runtime.describe() if runtime is not None else packed or "dense"
    if kept:
        counts = Counter(k.fmt for name, k in kept.items() if name != OUTPUT_HEAD)
        blocks = ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))
        linear = f"GGUF blocks ({blocks} layers), others {linear}"
    described = _describe_head(head, kept)
    return linear if described is None else f"{linear}, output head {described}"


def _describe_head(head: HeadFormat, kept: dict[str, KeptLinear]) -> str | None:
    """The head's format where it is not dense as loaded (None where it is)."""
    if head.is_gguf_blocks:
        return f"{kept[OUTPUT_HEAD].fmt} (GGUF blocks)" if OUTPUT_HEAD in kept else None
    return head.packed


def _resolved_head(head_format: str | HeadFormat) -> HeadFormat:
    head = HeadFormat.of(head_format)  # an option value as given (tests, benchmarks)
    if head.is_auto:
        raise ValueError("head format auto is resolved per checkpoint first (auto_formats)")
    return head


# How `auto` runs a GGUF file on the C++ kernels. Every linear layer whose block type the kernels
# hold (densa.quant.gguf_blocks: Q4_0, Q4_1, Q4_K as w4a8, Q5_0 and Q3_K as w5a8, Q6_K as
# w6a8, Q5_1 and Q5_K as w5ma8, Q8_0, IQ4_NL and IQ4_XS as w8) keeps its blocks (weight format
# `blocks`, gguf_loading), others load dense, with one warning naming their types; a file whose
# layers are mostly Q4_0/Q4_1 also packs those others as w4a8 (what SmolLM2's Q4_1 file always
# did).
# An untied head keeps its blocks the same way (HeadFormat.BLOCKS); a head tied to a Q8_0
# embedding is packed as w8 from it.
AUTO_LINEAR = {"Q4_0": LinearFormat.W4A8, "Q4_1": LinearFormat.W4A8}
AUTO_HEAD = {"Q8_0": HeadFormat.W8}


def auto_formats(
    model_path: str,
    model_dir: Path,
    weight_format: str | LinearFormat,
    head_format: str | HeadFormat,
) -> tuple[LinearFormat, HeadFormat]:
    """Resolve `auto` (see AUTO_LINEAR): GGUF files run from their blocks on the C++ kernels
    where they are built; everything else loads as its checkpoint says (dense for HF
    directories). Returns (weights, head)."""
    stored = stored_quantization(model_dir) if str(model_path).endswith(".gguf") else {}
    kernels = native.is_available()
    weights = LinearFormat.of(weight_format)  # parsed here: the option enters the engine here
    if weights.is_auto and kernels and stored:
        weights = AUTO_LINEAR.get(str(stored.get("linear")), LinearFormat.BLOCKS)
    head = HeadFormat.of(head_format)
    if head.is_auto:
        head = _auto_head(model_dir, stored) if kernels else HeadFormat.DENSE
    return weights, head


def auto_dtype(model_path: str, model_dir: Path, dtype: str) -> str:
    """Resolve `--dtype auto`: a checkpoint whose config says bfloat16 (`torch_dtype`, or
    `dtype` as transformers 5 writes it) computes and keeps its dense weights in bfloat16, as
    shipped -- upcasting would double their memory; everything else (GGUF files, float32 and
    float16 checkpoints) in float32, the CPU default (bf16 compute degrades small models)."""
    if dtype != "auto":
        return dtype
    if str(model_path).endswith(".gguf"):
        return "float32"
    config = json.loads((model_dir / "config.json").read_text())
    stored = config.get("torch_dtype") or config.get("dtype")
    return "bfloat16" if stored == "bfloat16" else "float32"


def _auto_head(model_dir: Path, stored: dict[str, str | None]) -> HeadFormat:
    head = stored.get("head")
    if head is None:
        return HeadFormat.DENSE
    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    if not tied and gguf_blocks.common_family([head]) is not None:
        return HeadFormat.BLOCKS
    return AUTO_HEAD.get(head, HeadFormat.DENSE)
