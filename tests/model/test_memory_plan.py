"""The memory check before loading (densa/setup/memory_plan.py): the weights it plans are the
bytes the loader then holds, exactly, in every format; it passes with room, and refuses in one
line naming what would fit when the (injected) available memory is too small."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from densa.kernels.cpu import native
from densa.model.arch import ArchConfig, ModelLoadError
from densa.model.linear import resident_weight_bytes
from densa.model.loader import auto_dtype, auto_formats, load_model, resolve_model_dir
from densa.setup.args import EngineArgs
from densa.setup.memory_plan import (
    SKIP_ENV,
    Available,
    available_memory,
    check_memory,
    plan_weights,
)

from .test_gguf_quants import MIXES, write_tiny_gguf

needs_kernels = pytest.mark.skipif(not native.is_available(), reason="no C++ kernels here")
CPU = torch.device("cpu")
EMBEDDING = 49152 * 256 * 4  # tied to the head, float32
NORMS = (2 * 2 + 1) * 256 * 4
# Per layer, [out, in]: q|k|v [512, 256], o [256, 256], gate|up [1024, 256], down [256, 512].
DENSE_LINEARS = 2 * 4 * (512 * 256 + 256 * 256 + 1024 * 256 + 256 * 512)
W4A8_LINEARS = 2 * 320 * (32 * 8 + 16 * 8 + 64 * 8 + 16 * 16)  # 320 bytes per 16 x 32 block
W8A8_LINEARS = W4A8_LINEARS * 544 // 320
# Q4_K_M: q|k (384 rows), o, gate|up as w4a8; v (128 rows) and down as w6a8 (448-byte blocks).
Q4_K_M_LINEARS = 2 * (320 * (24 * 8 + 16 * 8 + 64 * 8) + 448 * (8 * 8 + 16 * 16))


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("memory-plan")
    paths = {}
    for mix in ("Q4_0", "Q8_0", "Q4_K", "Q4_K_M"):
        paths[mix] = root / f"tiny-{mix}.gguf"
        write_tiny_gguf(paths[mix], mix.removesuffix("_M"), MIXES[mix])
    return paths


def _formats(path: Path, weight_format: str) -> tuple[Path, ArchConfig, str, str]:
    model_dir = resolve_model_dir(str(path))
    weights, head = auto_formats(str(path), model_dir, weight_format, "dense")
    return model_dir, ArchConfig.from_dir(model_dir), weights, head


@needs_kernels
@pytest.mark.parametrize(
    "mix, weight_format, linear_bytes",
    [
        ("Q4_0", "auto", W4A8_LINEARS),  # kept as w4a8
        ("Q8_0", "w8a8", W8A8_LINEARS),  # kept as w8a8
        ("Q4_K", "auto", W4A8_LINEARS),  # auto keeps every block type the kernels run
        ("Q4_K", "w4a8", W4A8_LINEARS),
        ("Q4_K_M", "w4a8", Q4_K_M_LINEARS),  # q|k|v sharded: v and down keep Q6_K as w6a8
        ("Q8_0", "dense", DENSE_LINEARS),
    ],
)
def test_planned_weights_are_the_loaded_bytes(
    mix: str, weight_format: str, linear_bytes: int, tiny_ggufs: dict[str, Path]
) -> None:
    model_dir, arch, weights, head = _formats(tiny_ggufs[mix], weight_format)
    plan = plan_weights(model_dir, arch, "float32", 64, CPU, weights, head)
    model = load_model(model_dir, arch, "float32", 64, CPU, weights, head)
    assert plan.resident_bytes == resident_weight_bytes(model)
    assert plan.resident_bytes == EMBEDDING + NORMS + linear_bytes
    # The huge-page copy of every weight is the peak, except where the largest tensor
    # (the embedding) is dequantized twice.
    assert plan.transient_bytes == max(plan.resident_bytes, 2 * EMBEDDING)


def _check(path: Path, free: int, **options: object) -> object:
    model_dir, arch, weights, head = _formats(path, "auto")
    dtype = auto_dtype(str(path), model_dir, "auto")  # resolved first, as the builder does
    args = EngineArgs(model=str(path), max_model_len=512, weight_format=weights, head_format=head,
                      dtype=dtype)  # fmt: skip
    args = dataclasses.replace(args, **options)  # type: ignore[arg-type]
    config = args.resolve(arch, str(path))
    return check_memory(
        config, model_dir, arch, args.kv_format(), available=lambda: Available(free, "test")
    )


@needs_kernels
def test_check_passes_with_room_and_names_what_fits_without(
    tiny_ggufs: dict[str, Path],
) -> None:
    path = tiny_ggufs["Q8_0"]
    plan = _check(path, 64 * 2**30, kv_cache_memory="256MiB")
    assert plan is not None
    needed = plan.needed_bytes  # type: ignore[attr-defined]
    with pytest.raises(ModelLoadError) as failed:
        _check(path, needed - 100 * 2**20, kv_cache_memory="256MiB")
    line = str(failed.value)
    assert "\n" not in line and line.startswith("not enough memory: ")
    assert "KV cache 256.00 MiB" in line and "is available (test)" in line
    # 100 MiB less room: the KV cache that fits is 100 MiB smaller (whole MiB); it passes.
    assert "--kv-cache-memory 156MiB" in line
    # 4-bit linears would save 0.5 MiB of this embedding-heavy model: not offered.
    assert "--weight-format" not in line
    assert _check(path, needed - 100 * 2**20, kv_cache_memory="156MiB") is not None
    with pytest.raises(ModelLoadError, match="no smaller setting fits"):
        _check(path, 2**20)


def test_skipped_by_flag_env_and_off_the_cpu(
    tiny_ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_ggufs["Q4_0"]
    assert _check(path, 0, skip_memory_check=True) is None
    assert _check(path, 0, device="cuda") is None
    monkeypatch.setenv(SKIP_ENV, "1")
    assert _check(path, 0) is None


def test_available_memory_reads_meminfo_and_the_cgroup_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable:    4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_memory(meminfo, cgroup) == Available(4_096_000_000, "MemAvailable")
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert available_memory(meminfo, cgroup).source == "MemAvailable"
    (cgroup / "memory.max").write_text("2000000000\n")
    assert available_memory(meminfo, cgroup) == Available(1_999_999_000, "the cgroup limit")
