"""`densa quantize`: convert a checkpoint's linear weights to INT4 or FP8 and save it.

source (HF dir, .gguf, or a densa INT4/FP8 checkpoint -- dequantized first)
  -> [GPTQ only] run calibration text through the dense model, collect each linear layer's
     input Hessian
  -> quantize every linear weight (not embeddings or the output head unless asked); stacked MoE
     expert weights expert by expert, routers kept in high precision (model.quant_targets)
  -> <dst>/model.safetensors with the format in its metadata, config.json, tokenizer files
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from densa.model import gguf
from densa.model.arch import ArchConfig
from densa.model.attention import AttentionMetadata, TorchAttentionBackend, build_group
from densa.model.checkpoint_files import dense_checkpoint, read_stored_format, safetensors_files
from densa.model.gguf import GGUFFile
from densa.model.interface import CausalLM
from densa.model.kv_layout import scratch_caches
from densa.model.lineage import lineage_metadata
from densa.model.loader import DTYPES, load_model, resolve_model_dir
from densa.model.quant_targets import QuantScope, quantization_targets
from densa.model.registry import kv_layout, meta_skeleton, model_factory
from densa.model.runtime_weights import linear_module_of, runtime_tensors
from densa.quant.calibration import HessianCollector
from densa.quant.calibration_data import calibration_passages
from densa.quant.checkpoint import Value, quantize_tensors, write_checkpoint
from densa.quant.quantizer import make_quantizer
from densa.quant.weight_format import CheckpointFormat, WeightFormat
from densa.text.tokenizer import Tokenizer

CALIBRATION_SEQ_LEN = 512  # passages are packed into sequences of at most this many tokens


@dataclass(frozen=True)
class QuantizeSettings:
    fmt: WeightFormat | None  # None: no quantization, only cast (a BF16 reference checkpoint)
    keep_dtype: str = "bfloat16"  # tensors left unquantized: embeddings, norms, output head
    include_head: bool = False  # quantize the output head too (untied models only)
    calibration_passages: int = 128  # GPTQ: LAMBADA passages (~80 tokens each)
    show_progress: bool = True
    keep_shared_experts: bool = False  # MoE: shared experts stay in keep_dtype
    experts_only: bool = False  # MoE: quantize only the routed experts (as INT4 MoE releases do)

    @property
    def scope(self) -> QuantScope:
        return QuantScope(self.include_head, self.keep_shared_experts, self.experts_only)


@dataclass(frozen=True)
class QuantizeResult:
    source_bytes: int  # the dense source's weight files (a GGUF source: as float32)
    source_file_bytes: int  # a GGUF source's own file; 0 for directories
    output_bytes: int
    num_quantized: int
    calibration_tokens: int
    output_dir: Path


def quantize_checkpoint(src: str, dst: Path, settings: QuantizeSettings) -> QuantizeResult:
    """Write the quantized copy of `src` into `dst` (created; must not hold a checkpoint)."""
    src_dir = resolve_model_dir(src)
    if (dst / "config.json").exists():
        raise FileExistsError(f"{dst} already holds a checkpoint; pick a new folder")
    arch = ArchConfig.from_dir(src_dir)
    with meta_skeleton():
        skeleton = model_factory(arch.architecture)(arch, 1, torch.device("cpu"))
    targets = quantization_targets(skeleton, settings.scope) if settings.fmt else set()
    hessians: dict[str, torch.Tensor] = {}
    calibration_tokens = 0
    if settings.fmt is not None and make_quantizer(settings.fmt).needs_calibration:
        hessians, calibration_tokens = collect_hessians(src_dir, arch, targets, settings)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _output_tensors(src_dir, skeleton, targets, hessians, settings)
    ckpt = CheckpointFormat(settings.fmt) if settings.fmt is not None else None
    lineage = lineage_metadata(src_dir)  # prefill (source) and decode (this) pair up by it
    write_checkpoint(dst, _with_progress(tensors, src_dir, settings.show_progress), ckpt, lineage)
    _copy_side_files(src_dir, dst, settings.fmt)
    return QuantizeResult(
        source_bytes=_weight_bytes(src_dir),
        source_file_bytes=_file_bytes(Path(src).expanduser()),
        output_bytes=_weight_bytes(dst),
        num_quantized=len(ckpt.tensors) if ckpt is not None else 0,
        calibration_tokens=calibration_tokens,
        output_dir=dst,
    )


def collect_hessians(
    src_dir: Path, arch: ArchConfig, targets: set[str], settings: QuantizeSettings
) -> tuple[dict[str, torch.Tensor], int]:
    """Input Hessians of the target layers over the calibration text, by module name, and the
    number of calibration tokens. All from the dense float32 model (not layer by layer through
    the already-quantized layers, as the original GPTQ does: simpler, and close in quality)."""
    model = load_model(src_dir, arch, "float32", CALIBRATION_SEQ_LEN, torch.device("cpu"), "dense")
    tokenizer = Tokenizer.from_dir(src_dir, arch.eos_token_ids)
    passages = calibration_passages(settings.calibration_passages)
    sequences = pack_sequences([tokenizer.encode(p) for p in passages], CALIBRATION_SEQ_LEN)
    modules = {name: model.get_submodule(name) for name in targets}
    with HessianCollector(modules) as collector:
        for token_ids in tqdm(sequences, "calibrating", disable=not settings.show_progress):
            run_sequence(model, arch, token_ids)
    return collector.hessians, collector.num_tokens


def pack_sequences(passages: list[list[int]], max_len: int) -> list[list[int]]:
    """Concatenate tokenized passages greedily into sequences of at most max_len tokens."""
    sequences: list[list[int]] = [[]]
    for tokens in passages:
        tokens = tokens[:max_len]
        if len(sequences[-1]) + len(tokens) > max_len:
            sequences.append([])
        sequences[-1].extend(tokens)
    return [s for s in sequences if s]


@torch.inference_mode()
def run_sequence(
    model: CausalLM, arch: ArchConfig, token_ids: list[int], page_size: int = 16
) -> torch.Tensor:
    """One causal forward pass over a single sequence through a scratch paged KV cache (the
    engine's own path, minus the engine); returns the final hidden states [T, hidden]."""
    num_tokens = len(token_ids)
    num_pages = -(-num_tokens // page_size)
    dtype = next(model.parameters()).dtype
    caches = scratch_caches(kv_layout(arch.architecture), arch, num_pages, page_size, dtype)
    positions = torch.arange(num_tokens)
    pages = list(range(num_pages))
    meta = AttentionMetadata(
        slot_pages=positions // page_size,
        slot_offsets=positions % page_size,
        decode=None,
        prefill=build_group(0, [pages], [num_tokens], [num_tokens], page_size, positions.device),
    )
    return model(torch.tensor(token_ids), positions, caches, meta, TorchAttentionBackend())


def _output_tensors(
    src_dir: Path,
    skeleton: CausalLM,
    targets: set[str],
    hessians: dict[str, torch.Tensor],
    settings: QuantizeSettings,
) -> Iterator[tuple[str, Value]]:
    checkpoint, _ = dense_checkpoint(src_dir)
    gguf_source = GGUFFile.of_converted(src_dir) is not None
    # densa's own format or a shipped one (FP8 blocks, INT4 packs): each weight dequantized as
    # it is read, then quantized, so no dense copy of the model is ever held.
    stored = None if gguf_source else read_stored_format(safetensors_files(src_dir))
    dense = runtime_tensors(checkpoint, skeleton, stored, None, set())
    if settings.fmt is None:
        keep = DTYPES[settings.keep_dtype]
        return ((name, t.to(keep) if t.is_floating_point() else t) for name, t in dense)

    def is_target(name: str) -> bool:
        return linear_module_of(skeleton, name) in targets

    def hessian_of(name: str) -> torch.Tensor | None:
        module = linear_module_of(skeleton, name)
        return hessians.get(module) if module is not None else None

    quantizer = make_quantizer(settings.fmt)
    keep_dtype = DTYPES[settings.keep_dtype]
    return quantize_tensors(dense, quantizer, is_target, hessian_of, keep_dtype)


def _with_progress(
    tensors: Iterator[tuple[str, Value]], src_dir: Path, enabled: bool
) -> Iterator[tuple[str, Value]]:
    _, total = dense_checkpoint(src_dir)
    yield from tqdm(tensors, "quantizing", total=total, unit="tensor", disable=not enabled)


def _copy_side_files(src_dir: Path, dst: Path, fmt: WeightFormat | None) -> None:
    """config.json (with a human-readable note of the format) and the tokenizer files. Never a
    GGUF conversion's own notes: they say the weights are read from that GGUF file, and a new
    checkpoint holding them would be loaded from the original file instead of its own weights."""
    skipped = {"config.json", gguf.SOURCE_FILE, gguf.QUANTIZATION_FILE}
    for path in src_dir.iterdir():
        is_weights = path.suffix == ".safetensors" or path.name.endswith(".index.json")
        if path.is_file() and not is_weights and path.name not in skipped:
            shutil.copy(path, dst / path.name)
    config = json.loads((src_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if fmt is not None:
        # For people and other tools only: densa reads the format from the safetensors metadata.
        config["quantization_config"] = {"quant_method": "densa", **asdict(fmt)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _file_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _weight_bytes(model_dir: Path) -> int:
    """The checkpoint's weight bytes; a converted GGUF's as float32 (what it dequantizes to)."""
    source = GGUFFile.of_converted(model_dir)
    if source is not None:
        return source.dense_bytes()
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
