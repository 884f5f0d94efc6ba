"""Find a checkpoint (HF directory or GGUF file), check it fits, build the model, load weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.gguf import ensure_converted
from densa.model.interface import CausalLM
from densa.model.registry import model_factory
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


def safetensors_files(model_dir: Path) -> list[Path]:
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


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {path} (truncated or corrupt?): {exc}") from exc


def check_fits(arch: ArchConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the weights need; refuse early if the machine clearly cannot hold them."""
    needed = arch.num_parameters() * torch.tensor([], dtype=dtype).element_size()
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


def load_model(
    model_dir: Path, arch: ArchConfig, dtype: str, max_position: int, device: torch.device
) -> CausalLM:
    torch_dtype = DTYPES[dtype]
    check_fits(arch, torch_dtype, device)
    factory = model_factory(arch.architecture)
    # Build without initializing (meta device), then allocate and fill from the checkpoint.
    with torch.device("meta"):
        model = factory(arch, max_position, device)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    model.tie_weights()
    files = safetensors_files(model_dir)
    try:
        with torch.no_grad():
            model.load_weights(iter_checkpoint(files))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"checkpoint in {model_dir} does not match its config: {exc}") from exc
    logger.info(
        "loaded %s (%s parameters, %s)", model_dir.name, f"{arch.num_parameters():,}", dtype
    )
    return model.eval()
