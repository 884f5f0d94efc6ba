"""A GGUF file's tensors in Hugging Face naming, read as views into the mmapped file: rows put
back in HF order (Llama's Q/K un-permuted), stacked experts and fused projections split,
DeepSeek's k_b and v_b joined back into kv_b_proj; and the file pages a consumed tensor used
handed back (`release_pages`)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from densa.model.arch import ModelLoadError
from densa.model.gguf_archs import EXPERT, KV_B_PARTS, ROW_VECTORS, GGUFArch

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


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
                yield hf_name(tensor.name, dialect), _joined_kv_b(k_b, v_b, config)
    if kv_b_parts:
        raise ModelLoadError(f"GGUF file has only one of k_b / v_b in layers {sorted(kv_b_parts)}")


def _stored_tensor(tensor: Any, config: dict[str, Any], dialect: GGUFArch) -> GGUFTensor:
    """A file tensor with its rows in HF order, before any splitting."""
    name = hf_name(tensor.name, dialect)
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


def hf_name(gguf_name: str, dialect: GGUFArch) -> str:
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
