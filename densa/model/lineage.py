"""Which checkpoint a model's weights come from, so a prefill worker serving the FP8 release and
a decode worker serving its INT4 conversion are known to be the same model, and two unrelated
checkpoints of the same architecture and tokenizer (two fine-tunes of one base) are not.

A checkpoint's fingerprint is a sha256 over what identifies its files cheaply, without reading
a terabyte: each weight file's size and header (tensor names, dtypes, shapes, offsets,
metadata) and 64 KiB of its data at the start, the middle and the end. `densa quantize` records
its source's lineage in the checkpoint it writes (safetensors metadata `densa.lineage`); a
checkpoint's lineage is that record if it has one, else its own fingerprint. So the FP8 release
and every conversion of it (of a conversion, too) share one lineage.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO

from densa.model.gguf import SOURCE_FILE

LINEAGE_KEY = "densa.lineage"
_SAMPLE_BYTES = 64 * 1024


def checkpoint_lineage(model_dir: Path) -> str:
    """The lineage of the checkpoint in `model_dir` (a converted GGUF: of its .gguf file)."""
    declared = _declared_lineage(model_dir)
    return declared if declared is not None else fingerprint(_weight_files(model_dir))


def fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            header_len = _safetensors_header_len(handle, size)
            handle.seek(0)
            digest.update(handle.read(min(header_len, size)))
            for offset in (header_len, (header_len + size) // 2, size - _SAMPLE_BYTES):
                handle.seek(max(0, offset))
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _safetensors_header_len(handle: BinaryIO, size: int) -> int:
    """Bytes of a safetensors file's length prefix and JSON header (0 for other files)."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        return 0
    length = int.from_bytes(prefix, "little")
    return 8 + length if 8 + length <= size else 0


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files, or the .gguf file a converted directory reads its weights from
    (named in its SOURCE_FILE: opening the GGUF itself would parse its whole vocabulary)."""
    source = model_dir / SOURCE_FILE
    if source.is_file():
        gguf_path = Path(json.loads(source.read_text())["path"])
        if gguf_path.is_file():
            return [gguf_path]
    return sorted(model_dir.glob("*.safetensors"))


def _declared_lineage(model_dir: Path) -> str | None:
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        if LINEAGE_KEY in metadata:
            return str(json.loads(metadata[LINEAGE_KEY])["source"])
    return None


def lineage_metadata(source_dir: Path) -> dict[str, str]:
    """The metadata entry a checkpoint converted from `source_dir` carries."""
    payload = {"source": checkpoint_lineage(source_dir), "source_name": source_dir.name}
    return {LINEAGE_KEY: json.dumps(payload)}
