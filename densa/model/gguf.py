"""Read a GGUF file (llama.cpp's format) into a Hugging Face-style directory densa can load.

Quantized GGUF tensors (Q4_K, Q5_0, Q6_K, Q8_0, ... whatever the file holds) are dequantized to
float32 once by the `gguf` package; the result (config.json, model.safetensors, tokenizer files)
is cached on disk, so later starts skip the conversion. What llama.cpp's converter changed is
undone per architecture (densa.model.gguf_archs): Llama's Q/K rows are un-permuted (llama.cpp
interleaves them for its rotary layout), Gemma's norm weights lose the 1 llama.cpp adds.
"""

from __future__ import annotations

import contextlib
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
from densa.model.gguf_archs import GGUF_ARCHS, GGUFArch
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


def ensure_converted(gguf_path: Path, progress: Progress | None = None) -> Path:
    """Return an HF directory for the GGUF file, converting it on first use."""
    out_dir = converted_dir_for(gguf_path)
    if (out_dir / "config.json").is_file():
        if not (out_dir / QUANTIZATION_FILE).is_file():  # converted by an older densa
            _write_quantization(_open_reader(gguf_path), out_dir)
        return out_dir
    logger.info("converting %s to a cached safetensors copy in %s (once)", gguf_path.name, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".converting-"))
    try:
        if progress is None:
            with _progress_bar(f"converting {gguf_path.name}") as bar:
                convert_gguf(gguf_path, tmp_dir, bar)
        else:
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


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None) -> None:
    from safetensors.torch import save_file

    reader = _open_reader(gguf_path)
    fields = _read_fields(reader)
    if "general.architecture" not in fields:
        raise ModelLoadError(f"{gguf_path} names no architecture: truncated or not a model file?")
    arch = str(fields.get("general.architecture"))
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})"
        )
    config = _hf_config(fields, arch, reader)
    tensors = dict(_dequantized_tensors(reader, config, GGUF_ARCHS[arch], progress))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_quantization(reader, out_dir)
    _save_tokenizer(gguf_path, out_dir)


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


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
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

    dialect = GGUF_ARCHS[arch]
    tensor_names = {t.name for t in reader.tensors}
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
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": int(bos.contents()) if bos is not None else None,
        "eos_token_id": int(eos.contents()) if eos is not None else None,
        "pad_token_id": int(pad.contents()) if pad is not None else None,
        "torch_dtype": "float32",
        **dialect.extras(get, num_layers),
    }


def _vocab_size(reader: Any) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ModelLoadError("GGUF file has no token_embd.weight tensor")


def _dequantized_tensors(
    reader: Any, config: dict[str, Any], dialect: GGUFArch, progress: Progress | None
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    unpermute = dialect.permuted_qk
    total = len(reader.tensors)
    for idx, tensor in enumerate(reader.tensors):
        name = _hf_name(tensor.name, dialect)
        # GGUF lists dims fastest-first; the dequantized numpy array is already [out, in].
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute(array, num_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute(array, num_kv_heads)
        elif dialect.norm_offset and name.endswith("norm.weight"):
            array = array - np.float32(dialect.norm_offset)
        yield name, torch.from_numpy(np.array(array, copy=True, order="C"))
        if progress is not None:
            progress(idx + 1, total)


def _hf_name(gguf_name: str, dialect: GGUFArch) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # "blk", "<n>", "<rest>"
    if parts[0] != "blk" or len(parts) != 3 or parts[2] not in dialect.layer_names:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{dialect.layer_names[parts[2]]}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved -> rotate-half halves), per head."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
