"""Read a GGUF file (llama.cpp's format) as a Hugging Face-style model densa can load.

`ensure_converted` writes what the loader needs beside the weights into a cache directory
(config.json, tokenizer files, a note of the stored types and of the source file); the weights
stay in the GGUF file and are read from it, mmapped, one tensor at a time
(densa.model.gguf_loading keeps the block types the CPU kernels run, everything else is
dequantized as it loads). No float32 copy is written for serving: a 1 GB Q4_K_M file would
become 6.6 GB on disk. Tools that need a transformers-readable checkpoint (the transformers
peer of `densa bench peers`, tests against transformers) ask for one with `ensure_dense_copy`.

What llama.cpp's converter changed is undone per architecture (densa.model.gguf_archs):
Llama's Q/K rows are un-permuted (llama.cpp interleaves them for its rotary layout), Gemma's
norm weights lose the 1 llama.cpp adds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densa.model.arch import ModelLoadError
from densa.model.gguf_archs import (
    EXPERT,
    GGUF_ARCHS,
    KV_B_PARTS,
    ROW_VECTORS,
    FileLayout,
    GGUFArch,
    gguf_dialect,
    rope_scaling,
)
from densa.utils.logging import get_logger

logger = get_logger(__name__)

# Linear weights of a layer, by their GGUF names (what the quantization record counts).
_LINEAR_KEYS = tuple(
    {
        key
        for arch in GGUF_ARCHS.values()
        for key in arch.layer_names
        if key.endswith(".weight") and "norm" not in key
    }
)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Progress = Callable[[int, int], None]


def default_cache_dir() -> Path:
    return Path(os.environ.get("DENSA_CACHE_DIR", Path.home() / ".cache" / "densa"))


def converted_dir_for(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted copy of this exact file lives (keyed by path, size and mtime)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{digest}"


QUANTIZATION_FILE = "gguf_quantization.json"
SOURCE_FILE = "gguf_source.json"  # the file a converted directory's weights are read from


def ensure_converted(gguf_path: Path, progress: Progress | None = None) -> Path:
    """Return an HF directory for the GGUF file, converting it on first use."""
    out_dir = converted_dir_for(gguf_path)
    if (out_dir / "config.json").is_file():
        if not (out_dir / QUANTIZATION_FILE).is_file():  # converted by an older densa
            _write_quantization(_open_reader(gguf_path), out_dir)
        if not (out_dir / SOURCE_FILE).is_file():
            _write_source(gguf_path, out_dir)
        return out_dir
    logger.info("reading %s's config and tokenizer into %s (once)", gguf_path.name, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        convert_gguf(gguf_path, tmp_dir, progress)
        tmp_dir.rename(out_dir)  # atomic: a crash never leaves a half-written cache entry
    except FileExistsError:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # another process converted it first
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


@contextlib.contextmanager
def _progress_bar(description: str) -> Iterator[Progress]:
    from tqdm import tqdm

    with tqdm(desc=description, unit="tensor", mininterval=0.5) as bar:

        def update(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield update


def ensure_dense_copy(model_dir: Path, progress: Progress | None = None) -> Path:
    """Give a converted GGUF directory a float32 model.safetensors (for transformers and other
    readers of HF checkpoints; densa itself reads the GGUF file). Written once, atomically."""
    target = model_dir / "model.safetensors"
    source = model_dir / SOURCE_FILE
    if target.is_file() or not source.is_file():
        return model_dir
    gguf_path = Path(json.loads(source.read_text())["path"])
    if not gguf_path.is_file():
        raise ModelLoadError(f"{model_dir} was converted from {gguf_path}, which is gone")
    reader = _open_reader(gguf_path)
    config = json.loads((model_dir / "config.json").read_text())
    dialect = GGUF_ARCHS[str(_read_fields(reader).get("general.architecture"))]
    logger.info("writing a float32 copy of %s for transformers into %s", gguf_path.name, target)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with contextlib.ExitStack() as stack:
            if progress is None:
                progress = stack.enter_context(_progress_bar(f"dequantizing {gguf_path.name}"))
            tensors = _dequantized_tensors(reader, config, dialect, progress)
            _save_streamed(reader, config, dialect, tensors, partial)
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)
    return model_dir


def convert_gguf(
    gguf_path: Path, out_dir: Path, progress: Progress | None = None, dense: bool = False
) -> None:
    """Config, tokenizer and notes of a GGUF file into `out_dir`; with `dense`, also the
    float32 weights (model.safetensors)."""
    reader = _open_reader(gguf_path, arrays=True)
    fields = _read_fields(reader)
    if "general.architecture" not in fields:
        raise ModelLoadError(f"{gguf_path} names no architecture: truncated or not a model file?")
    arch = str(fields.get("general.architecture"))
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})"
        )
    config = _hf_config(fields, arch, reader)
    if dense:
        tensors = _dequantized_tensors(reader, config, GGUF_ARCHS[arch], progress)
        _save_streamed(reader, config, GGUF_ARCHS[arch], tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_quantization(reader, out_dir)
    _write_source(gguf_path, out_dir)
    _save_tokenizer(gguf_path, out_dir)


def _save_streamed(
    reader: Any,
    config: dict[str, Any],
    dialect: GGUFArch,
    tensors: Iterator[tuple[str, torch.Tensor]],
    path: Path,
) -> None:
    """A float32 safetensors file written one tensor at a time (the header first, from the
    shapes): the dequantized model is never whole in memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in gguf_tensors(reader, config, dialect):
        nbytes = 4 * int(np.prod(tensor.shape))
        header[name] = {
            "dtype": "F32",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
    with path.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, value in tensors:
            if list(value.shape) != header[name]["shape"]:
                raise ModelLoadError(f"GGUF tensor {name} dequantized to an unexpected shape")
            out.write(value.contiguous().numpy().tobytes())


def _write_source(gguf_path: Path, out_dir: Path) -> None:
    size, mtime_ns = _stamp(gguf_path)
    source = {"path": str(gguf_path.resolve()), "size": size, "mtime_ns": mtime_ns}
    (out_dir / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


class GGUFFile:
    """A GGUF file's tensors as densa loads them (HF names, rows in densa's order), read from
    the mmapped file one at a time."""

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path, self.config = path, config
        self.reader = _open_reader(path)
        arch = str(_read_fields(self.reader).get("general.architecture"))
        if arch not in GGUF_ARCHS:
            raise ModelLoadError(f"GGUF architecture {arch!r} is not supported")
        self.dialect = GGUF_ARCHS[arch]
        self.reader.fields.clear()  # loading needs only the tensors

    @classmethod
    def of_converted(cls, model_dir: Path) -> GGUFFile | None:
        """The source of a directory `ensure_converted` made, if the file is still there."""
        source = model_dir / SOURCE_FILE
        if not source.is_file():
            return None
        recorded = json.loads(source.read_text())
        path = Path(recorded["path"])
        if not path.is_file() or _stamp(path) != (recorded["size"], recorded["mtime_ns"]):
            return None  # moved or changed since: the directory's own copy is what stays valid
        return cls(path, json.loads((model_dir / "config.json").read_text()))

    def types(self) -> dict[str, str]:
        """HF tensor name -> GGUF type name ("Q4_K", "F32", ...)."""
        return {_hf_name(t.name, self.dialect): t.tensor_type.name for t in self.reader.tensors}

    def release(self, raw: np.ndarray) -> None:
        """Drop a consumed tensor's file pages from this process (see release_pages)."""
        release_pages(raw, self.reader.data)

    def layouts(self) -> dict[str, tuple[str, int]]:
        """HF tensor name -> (GGUF type name, rows) of every tensor as the model loads it
        (fused and stacked ones split): what planning which layers keep their blocks needs."""
        return {name: (t.type_name, t.shape[0]) for name, t in self.tensors()}

    def tensor_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def count(self) -> int:
        return len(self.reader.tensors)

    def dense_bytes(self) -> int:
        """The tensors' bytes as float32."""
        return sum(4 * int(t.n_elements) for t in self.reader.tensors)

    def tensors(self) -> Iterator[tuple[str, GGUFTensor]]:
        return gguf_tensors(self.reader, self.config, self.dialect)


def _write_quantization(reader: Any, out_dir: Path) -> None:
    """Record how the GGUF stored its weights (the converted copy is dequantized): the most
    common type of the layers' linear weights and the type of the output head (the embedding
    when tied). The loader's `auto` formats keep those bits where densa has kernels for them."""
    from collections import Counter

    types = {t.name: t.tensor_type.name for t in reader.tensors}
    linear = Counter(kind for name, kind in types.items() if name.endswith(_LINEAR_KEYS))
    head = types.get("output.weight", types.get("token_embd.weight"))
    info = {"linear": linear.most_common(1)[0][0] if linear else None, "head": head}
    (out_dir / QUANTIZATION_FILE).write_text(json.dumps(info, indent=2) + "\n")


def stored_quantization(model_dir: Path) -> dict[str, str | None]:
    """What `_write_quantization` recorded for a converted GGUF ({} for other directories)."""
    path = model_dir / QUANTIZATION_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {"linear": data.get("linear"), "head": data.get("head")}


def _open_reader(path: Path, arrays: bool = False) -> Any:
    """The file's reader; without `arrays`, metadata arrays (the vocabulary) are skipped, not
    parsed (`gguf_index`): what reading tensors needs, ~0.2 s instead of ~11 s for 150k tokens."""
    from gguf import GGUFReader

    from densa.model.gguf_index import TensorIndexReader

    try:
        return (GGUFReader if arrays else TensorIndexReader)(str(path))
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from exc


def _read_fields(reader: Any) -> dict[str, Any]:
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.ggml."):
            continue  # vocabularies are large; the tokenizer is converted separately
        try:
            fields[name] = field.contents()
        except (ValueError, IndexError):
            continue
    return fields


def _hf_config(fields: dict[str, Any], arch: str, reader: Any) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    dialect = gguf_dialect(arch)
    tensor_names = frozenset(t.name for t in reader.tensors)
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    num_layers = int(get("block_count"))
    vocab = get("vocab_size") or _vocab_size(reader)
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    pad = reader.fields.get("tokenizer.ggml.padding_token_id")
    return {
        "architectures": [dialect.hf_architecture],
        "model_type": dialect.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling(get),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": int(bos.contents()) if bos is not None else None,
        "eos_token_id": int(eos.contents()) if eos is not None else None,
        "pad_token_id": int(pad.contents()) if pad is not None else None,
        "torch_dtype": "float32",
        **dialect.extras(FileLayout(get, tensor_names, num_layers)),
    }


def _vocab_size(reader: Any) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ModelLoadError("GGUF file has no token_embd.weight tensor")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the file stores it, rows already in densa's order (Llama's Q/K rows
    un-permuted: a row permutation applies to whole rows of blocks as to rows of values)."""

    type_name: str  # "Q4_K", "F32", ... (gguf.GGMLQuantizationType names)
    raw: np.ndarray  # [rows, row bytes] blocks (quantized) or the values themselves
    shape: tuple[int, ...]  # logical shape, [out, in] for weights
    norm_offset: float = 0.0  # subtracted after dequantizing (Gemma's 1 + w norms)

    def dequantize(self, rows_per_chunk: int = 4096) -> torch.Tensor:
        """float32, in chunks of rows (gguf's dequantize makes several temporaries per value)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        kind = GGMLQuantizationType[self.type_name]
        out = torch.empty(self.shape, dtype=torch.float32)
        flat = out.view(self.raw.shape[0], -1) if self.raw.ndim > 1 else out.view(1, -1)
        raw = self.raw if self.raw.ndim > 1 else self.raw.reshape(1, -1)
        for lo in range(0, raw.shape[0], rows_per_chunk):
            part = dequantize(np.asarray(raw[lo : lo + rows_per_chunk]), kind)
            values = np.array(part, dtype=np.float32)  # a copy: the file's pages are read-only
            flat[lo : lo + rows_per_chunk] = torch.from_numpy(values.reshape(-1, flat.shape[1]))
        if self.norm_offset:
            out -= self.norm_offset
        return out


@dataclass(frozen=True)
class JoinedTensor(GGUFTensor):
    """One HF tensor the file stores in parts (DeepSeek's kv_b_proj as k_b and v_b). It has no
    blocks of its own (`raw` is empty): its parts are dequantized and joined."""

    parts: tuple[GGUFTensor, ...] = ()
    join: Callable[..., torch.Tensor] | None = None

    def dequantize(self, rows_per_chunk: int = 4096) -> torch.Tensor:
        assert self.join is not None
        return self.join(*(part.dequantize(rows_per_chunk) for part in self.parts))


def gguf_tensors(
    reader: Any, config: dict[str, Any], dialect: GGUFArch
) -> Iterator[tuple[str, GGUFTensor]]:
    """The file's tensors in HF naming, one at a time (views into the mmapped file): stacked
    experts split per expert, fused projections split by rows, DeepSeek's k_b and v_b joined
    back into kv_b_proj."""
    names = {t.name for t in reader.tensors}
    kv_b_parts: dict[str, dict[str, GGUFTensor]] = {}  # layer -> the halves read so far
    for tensor in reader.tensors:
        stored = _stored_tensor(tensor, config, dialect)
        layer, _, rest = tensor.name.removeprefix("blk.").partition(".")
        if rest not in KV_B_PARTS:
            yield from _split(_hf_targets(tensor.name, dialect), stored, config)
        elif f"blk.{layer}.attn_kv_b.weight" not in names:  # else kv_b is stored whole too
            halves = kv_b_parts.setdefault(layer, {})
            halves[rest] = stored
            if len(halves) == len(KV_B_PARTS):
                del kv_b_parts[layer]
                k_b, v_b = (halves[part] for part in KV_B_PARTS)
                yield _hf_name(tensor.name, dialect), _joined_kv_b(k_b, v_b, config)
    if kv_b_parts:
        raise ModelLoadError(f"GGUF file has only one of k_b / v_b in layers {sorted(kv_b_parts)}")


def _stored_tensor(tensor: Any, config: dict[str, Any], dialect: GGUFArch) -> GGUFTensor:
    """A file tensor with its rows in HF order, before any splitting."""
    name = _hf_name(tensor.name, dialect)
    raw = tensor.data  # GGUF lists dims fastest-first: rows are the last dim
    if dialect.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        raw = _unpermute(raw, config["num_attention_heads"])
    elif dialect.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        raw = _unpermute(raw, config["num_key_value_heads"])
    offset = dialect.norm_offset if name.endswith("norm.weight") else 0.0
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if len(shape) == 1 and tensor.name.split(".", 2)[-1] in ROW_VECTORS:
        shape = (1, *shape)
    return GGUFTensor(tensor.tensor_type.name, raw, shape, offset)


def _split(
    targets: tuple[str, ...], tensor: GGUFTensor, config: dict[str, Any]
) -> Iterator[tuple[str, GGUFTensor]]:
    """A stored tensor as the HF tensors it holds: one per expert of a stacked [E, out, in]
    ("{e}" in the names), then one per row range of a fused one (q|k|v, gate|up)."""
    if EXPERT in targets[0]:
        for expert in range(tensor.shape[0]):
            one = replace(tensor, raw=tensor.raw[expert], shape=tensor.shape[1:])
            yield from _split(tuple(t.replace(EXPERT, str(expert)) for t in targets), one, config)
        return
    lo = 0
    for name, rows in zip(targets, _shard_rows(targets, tensor.shape[0], config), strict=True):
        shard = tensor if len(targets) == 1 else replace(
            tensor, raw=tensor.raw[lo : lo + rows], shape=(rows, *tensor.shape[1:])
        )  # fmt: skip
        yield name, shard
        lo += rows


def _shard_rows(targets: tuple[str, ...], rows: int, config: dict[str, Any]) -> list[int]:
    """Rows of each part of a fused tensor: q|k|v by the head counts, gate|up in halves."""
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    by_proj = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
    shards = [by_proj.get(name.split(".")[-2], rows // len(targets)) for name in targets]
    if len(targets) > 1 and sum(shards) != rows:
        raise ModelLoadError(f"a fused GGUF tensor of {rows} rows does not split into {targets}")
    return shards if len(targets) > 1 else [rows]


def _joined_kv_b(k_b: GGUFTensor, v_b: GGUFTensor, config: dict[str, Any]) -> JoinedTensor:
    """kv_b_proj [H * (nope + v), r] from llama.cpp's k_b [H, r, nope] and v_b [H, v, r]."""
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]

    def join(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_rows = k.reshape(heads, rank, nope).transpose(1, 2)  # [H, nope, r], as in kv_b
        return torch.cat([k_rows, v.reshape(heads, v_dim, rank)], dim=1).reshape(-1, rank)

    shape = (heads * (nope + v_dim), rank)
    return JoinedTensor("F32", np.empty(0, np.float32), shape, parts=(k_b, v_b), join=join)


def _dequantized_tensors(
    reader: Any, config: dict[str, Any], dialect: GGUFArch, progress: Progress | None
) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(1 for _ in gguf_tensors(reader, config, dialect))  # experts count one by one
    for idx, (name, tensor) in enumerate(gguf_tensors(reader, config, dialect)):
        yield name, tensor.dequantize()
        if progress is not None:
            progress(idx + 1, total)


def _hf_targets(gguf_name: str, dialect: GGUFArch) -> tuple[str, ...]:
    """The HF names of a GGUF tensor's parts: several for a fused tensor, "{e}" in them for a
    stacked one (densa.model.gguf_archs)."""
    if gguf_name in _GLOBAL_NAMES:
        return (_GLOBAL_NAMES[gguf_name],)
    parts = gguf_name.split(".", 2)  # "blk", "<n>", "<rest>"
    if parts[0] != "blk" or len(parts) != 3 or parts[2] not in dialect.layer_names:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    names = dialect.layer_names[parts[2]]
    listed = (names,) if isinstance(names, str) else names
    return tuple(f"model.layers.{parts[1]}.{name}" for name in listed)


def _hf_name(gguf_name: str, dialect: GGUFArch) -> str:
    """The HF name a GGUF tensor loads as; for one holding several, its first part (expert 0,
    the q or gate shard)."""
    return _hf_targets(gguf_name, dialect)[0].replace(EXPERT, "0")


_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


def release_pages(array: np.ndarray, mapping: np.ndarray) -> None:
    """Let go of the pages of `mapping` (a read-only memmap of a file) that `array`, a view
    into it, was read from: a file mapping keeps every page it touched resident in the process
    (RSS) until unmapped, so a loader that read the whole file would hold it all once more
    beside the weights it built. The pages stay in the page cache; touching them again reads
    them back. Anything not inside the mapping is left alone (madvise would zero heap pages)."""
    libc = _libc()
    if libc is None or array.nbytes == 0 or not isinstance(mapping, np.memmap):
        return
    if mapping.mode not in ("r", "c"):
        return
    start, low = _address(array), _address(mapping)
    if start < low or start + array.nbytes > low + mapping.nbytes:
        return  # a copy (an un-permuted tensor), not the file's own pages
    page = mmap.PAGESIZE
    first, last = max(start // page * page, low), -(-(start + array.nbytes) // page) * page
    libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


@functools.cache
def _libc() -> Any:
    if sys.platform != "linux":
        return None
    return ctypes.CDLL(None, use_errno=True)


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved -> rotate-half halves), per head."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    _gguf_tokenizer(gguf_path).save_pretrained(str(out_dir))


def _gguf_tokenizer(gguf_path: Path) -> Any:
    """transformers' tokenizer for the file; where transformers reads no model config for the
    architecture (deepseek2), the generic fast tokenizer, built from the file's vocabulary alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
