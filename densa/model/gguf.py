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
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densa.model.arch import ModelLoadError
from densa.model.catalog import default_cache_dir
from densa.model.gguf_archs import (
    GGUF_ARCHS,
    FileLayout,
    GGUFArch,
    gguf_dialect,
    rope_scaling,
)
from densa.model.gguf_tensors import GGUFTensor, gguf_tensors, hf_name, release_pages
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

Progress = Callable[[int, int], None]


def converted_dir_for(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted copy of this exact file lives (keyed by path, size and mtime)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{digest}"


QUANTIZATION_FILE = "gguf_quantization.json"
SOURCE_FILE = "gguf_source.json"  # the file a converted directory's weights are read from
GENERATION_FILE = "generation_config.json"  # the end-of-generation tokens (HF's own file)

# Added tokens that end generation wherever a vocabulary has them, as llama.cpp reads them: a
# GGUF names one eos token, but an instruct model also ends turns with the others it was trained
# on (Qwen2.5-Coder writes `</tool_call>\n<|endoftext|>` after a call, never `<|im_end|>`; an
# engine that stops only at the file's eos writes a second call instead). The FIM tokens end a
# fill-in-the-middle answer at a file or repository boundary.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
        "<end_of_turn>", "<EOT>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    }
)  # fmt: skip


def ensure_converted(gguf_path: Path, progress: Progress | None = None) -> Path:
    """Return an HF directory for the GGUF file, converting it on first use."""
    out_dir = converted_dir_for(gguf_path)
    if (out_dir / "config.json").is_file():
        if not (out_dir / QUANTIZATION_FILE).is_file():  # converted by an older densa
            _write_quantization(_open_reader(gguf_path), out_dir)
        if not (out_dir / SOURCE_FILE).is_file():
            _write_source(gguf_path, out_dir)
        if not (out_dir / GENERATION_FILE).is_file():
            write_generation_config(out_dir)
        return out_dir
    logger.info("reading %s's config and tokenizer into %s (once)", gguf_path.name, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        convert_gguf(gguf_path, tmp_dir, progress)
        tmp_dir.rename(out_dir)  # atomic: a crash never leaves a half-written cache entry
    except OSError as exc:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not _lost_the_race(exc, out_dir):
            raise
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _lost_the_race(exc: OSError, out_dir: Path) -> bool:
    """Whether a rename failed because another process converted the same file first: renaming
    onto its (non-empty) directory fails with ENOTEMPTY on Linux, EEXIST elsewhere."""
    converted = (out_dir / "config.json").is_file()
    return exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and converted


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
    write_generation_config(out_dir)


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


def write_generation_config(model_dir: Path) -> None:
    """generation_config.json naming every end-of-generation token of a converted directory:
    config.json's eos first, then the added tokens of END_OF_GENERATION_TEXTS (read from the
    saved tokenizer.json, so an older conversion gains the file without re-reading the GGUF)."""
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    tokenizer_path = model_dir / "tokenizer.json"
    added = (
        json.loads(tokenizer_path.read_text()).get("added_tokens", [])
        if tokenizer_path.is_file()
        else []
    )
    ids += sorted(t["id"] for t in added if t.get("content") in END_OF_GENERATION_TEXTS)
    generation = {"eos_token_id": list(dict.fromkeys(ids))}  # the file's own eos stays first
    if config.get("bos_token_id") is not None:
        generation["bos_token_id"] = config["bos_token_id"]
    (model_dir / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")


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
        return {hf_name(t.name, self.dialect): t.tensor_type.name for t in self.reader.tensors}

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


def _dequantized_tensors(
    reader: Any, config: dict[str, Any], dialect: GGUFArch, progress: Progress | None
) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(1 for _ in gguf_tensors(reader, config, dialect))  # experts count one by one
    for idx, (name, tensor) in enumerate(gguf_tensors(reader, config, dialect)):
        yield name, tensor.dequantize()
        if progress is not None:
            progress(idx + 1, total)


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
