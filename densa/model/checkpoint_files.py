"""A checkpoint's files: which safetensors files hold it, its tensors as stored, and the weight
format it declares (densa's own metadata, or a shipped producer's quantization_config)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from densa.model.arch import ModelLoadError
from densa.model.gguf import GGUFFile
from densa.quant.checkpoint import read_format
from densa.quant.shipped import read_shipped_format
from densa.quant.shipped_config import UnsupportedCheckpoint
from densa.quant.weight_format import CheckpointFormat


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of an HF directory (its index's, else every *.safetensors), all present."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} holds no *.safetensors weights (convert .bin checkpoints first)"
        )
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"weight file {path} listed in the index is missing")
    return files


def dense_checkpoint(model_dir: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """A checkpoint's tensors as stored, and how many there are; a converted GGUF directory's
    come from its file, dequantized to float32 one at a time (it holds no weights of its own)."""
    source = GGUFFile.of_converted(model_dir)
    if source is not None:
        return ((name, tensor.dequantize()) for name, tensor in source.tensors()), source.count()
    files = safetensors_files(model_dir)
    return iter_checkpoint(files), checkpoint_size(files)


def checkpoint_size(files: list[Path]) -> int:
    """The number of tensors in safetensors files (headers only)."""
    from safetensors import safe_open

    count = 0
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            count += len(list(handle.keys()))
    return count


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the safetensors files, read one at a time."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {path} (truncated or corrupt?): {exc}") from exc


def read_stored_format(files: list[Path]) -> CheckpointFormat | None:
    """densa's own format (safetensors metadata), else a shipped producer's
    (config.json's quantization_config), else None (dense)."""
    from safetensors import SafetensorError

    try:
        return read_format(files) or read_shipped_format(files[0].parent, files)
    except UnsupportedCheckpoint as exc:
        raise ModelLoadError(f"cannot load {files[0].parent}: {exc}") from exc
    except (SafetensorError, OSError) as exc:
        where = files[0].parent
        raise ModelLoadError(
            f"cannot read the weights in {where} (truncated or corrupt?): {exc}"
        ) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"the checkpoint's weight format metadata is invalid: {exc}") from exc
