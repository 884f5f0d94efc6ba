"""What two workers must share to exchange K/V pages, and the check both run at the handshake.

Formats may differ on purpose (prefill BF16 KV, decode FP8 KV: pages are converted at landing);
the model may not: the same architecture and shapes, the same vocabulary and tokenizer, the same
page size, and weights of one lineage (an FP8 release and its INT4 conversion pair up; two
fine-tunes of one base do not: densa.model.lineage). A mismatch is refused with a message that
names every difference, never a silent corruption (SGLang's transfer paired BF16 with FP8 pages
and produced garbage).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from densa.disagg.messages import PageFormat, PeerModel
from densa.formats.kv_format import KVFormat
from densa.ipc.messages import TokenizerFiles
from densa.model.kv_layout import INDEX_BLOCK, KVGeometry


def tokenizer_digest(files: TokenizerFiles) -> str:
    digest = hashlib.sha256()
    for text in (files.tokenizer_json, files.config_json, files.chat_template):
        digest.update((text or "").encode())
        digest.update(b"\0")
    return digest.hexdigest()


def peer_model(
    architecture: dict[str, Any],
    tokenizer: TokenizerFiles,
    page: PageFormat,
    role: str,
    weight_format: str = "",
    lineage: str = "",
) -> PeerModel:
    # As the wire carries it (tuples become lists), so both sides compare like with like.
    plain = msgspec.to_builtins(architecture)
    return PeerModel(plain, tokenizer_digest(tokenizer), page, role, weight_format, lineage)


def is_landable(page: PageFormat) -> bool:
    """Is `page`'s format one densa serves (and so can land, converting if it must: landing
    converts between any two served formats, densa/worker/kv_io.py)?"""
    try:
        KVFormat.from_wire(page.kv_dtype, page.kv_scales)
    except ValueError:
        return False
    return True


def expected_page_bytes(architecture: dict[str, Any], page: PageFormat) -> int:
    """Bytes of one page of `page`'s format for this model (what the peer must announce), by
    the arithmetic that sizes our own pages (KVGeometry.page_bytes, as kv_pages.page_bytes).
    Raises ValueError for a format densa does not serve."""
    kv_format = KVFormat.from_wire(page.kv_dtype, page.kv_scales)
    return signature_geometry(architecture).page_bytes(page.page_size, kv_format)


def signature_geometry(architecture: dict[str, Any]) -> KVGeometry:
    """The pages' geometry read off a model's signature (ArchConfig.signature): a peer's
    signature is a dict, not an ArchConfig, so its layout is read from what it holds (latent
    when it has "mla", index keys when it has "dsa") rather than from the registry."""
    layers, parts, heads, dim = page_geometry(architecture)
    index = index_geometry(architecture)
    return KVGeometry(layers, parts, heads, dim, None if index is None else KVGeometry(*index))


def page_geometry(architecture: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(layers, parts, heads, dim) of a model's pages, from its signature: K and V per KV head,
    or for latent attention (MLA) one part, one "head" of kv_lora_rank + rope dim values."""
    mla = architecture.get("mla")
    if isinstance(mla, dict):
        latent_dim = mla.get("kv_lora_rank", 0) + mla.get("rope_head_dim", 0)
        return architecture["num_layers"], 1, 1, latent_dim
    heads, dim = architecture["num_kv_heads"], architecture["head_dim"]
    return architecture["num_layers"], 2, heads, dim


def index_geometry(architecture: dict[str, Any]) -> tuple[Any, Any, Any, Any] | None:
    """(indexer layers, 1, blocks, block) of sparse attention's index keys, from a signature's
    "dsa" (densa.model.kv_layout's sparse layout), or None without sparse attention."""
    dsa = architecture.get("dsa")
    if not isinstance(dsa, dict):
        return None
    head_dim = dsa.get("head_dim", 0)
    block = min(head_dim, INDEX_BLOCK)
    return sum(bool(full) for full in dsa.get("full_layers", ())), 1, head_dim // block, block


def mismatch(ours: PeerModel, theirs: PeerModel) -> str | None:
    """Why these two workers cannot exchange pages, or None if they can."""
    problems = []
    for key in sorted(set(ours.architecture) | set(theirs.architecture)):
        mine, other = ours.architecture.get(key), theirs.architecture.get(key)
        if mine != other:
            problems.append(f"{key}: {mine!r} here, {other!r} there")
    if ours.tokenizer_digest != theirs.tokenizer_digest:
        problems.append("the tokenizers differ")
    if ours.lineage and theirs.lineage and ours.lineage != theirs.lineage:
        problems.append(
            f"the weights come from different checkpoints (lineage {ours.lineage[:12]} here, "
            f"{theirs.lineage[:12]} there): convert the decode checkpoint from the prefill "
            "worker's with densa quantize"
        )
    if ours.page.page_size != theirs.page.page_size:
        problems.append(f"page size: {ours.page.page_size} here, {theirs.page.page_size} there")
    if not is_landable(theirs.page):
        problems.append(
            f"their KV format {theirs.page.kv_dtype!r} ({theirs.page.kv_scales!r} scales) "
            "cannot be landed"
        )
    elif "num_layers" in theirs.architecture and not problems:
        expected = expected_page_bytes(theirs.architecture, theirs.page)
        if theirs.page.page_bytes != expected:
            problems.append(
                f"their {theirs.page.kv_dtype} pages are announced as {theirs.page.page_bytes} "
                f"bytes, but this model's take {expected}"
            )
    if theirs.role == ours.role:
        problems.append(f"both workers have role {ours.role!r}")
    if not problems:
        return None
    return "kv_peer_mismatch: the prefill and decode workers cannot exchange KV pages: " + (
        "; ".join(problems)
    )
