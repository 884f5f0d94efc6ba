"""What a step carries of device KV, taken in before the step computes (ModelRunner.begin):
pages copied out (KVExport) first, then pages copied in (KVLanding), tags checked before any
write; and what that answered, kept for the step's output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from densa.cache.integrity import IntegrityViolation
from densa.model.kv_layout import LayerCache
from densa.sched.mirror import ScheduledRequest
from densa.sched.output import KVExport, KVLanding, PackedPages
from densa.utils.logging import get_logger
from densa.worker import kv_io
from densa.worker.integrity import IntegrityChecker
from densa.worker.sampler import Sampler

logger = get_logger(__name__)


@dataclass
class Begun:
    """A step's deltas, taken in (ModelRunner.begin): what is left to compute, and what it
    already answered."""

    items: list[ScheduledRequest] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    exported: dict[str, PackedPages] = field(default_factory=dict)
    refused_landings: list[IntegrityViolation] = field(default_factory=list)


@torch.inference_mode()
def export_pages(caches: list[LayerCache], exports: list[KVExport]) -> dict[str, PackedPages]:
    """Each export's pages, packed as they are (no tag is checked: see KVExport)."""
    return {export.export_id: kv_io.pack(caches, export.page_ids) for export in exports}


@torch.inference_mode()
def land_pages(
    caches: list[LayerCache],
    landings: list[KVLanding],
    integrity: IntegrityChecker,
    sampler: Sampler,
    begun: Begun,
) -> None:
    """Write each landing whose writer still owns every destination page (tags checked
    against the table the step's updates just refreshed); a writer that failed is among
    `begun.errors`, a refused one among `begun.refused_landings` too."""
    for landing in landings:
        violation = integrity.check_write(landing.request_id, landing.page_ids, landing.page_tags)
        if violation is not None:  # dropped whole: it can never touch another's pages
            begun.refused_landings.append(violation)
            begun.errors[landing.request_id] = violation.message
            continue
        try:
            kv_io.land(caches, landing.page_ids, landing.pages)
        except Exception as exc:  # confined to this writer, as a failed step would be
            if not isinstance(exc, kv_io.LandingError):
                logger.exception("landing K/V for %s failed", landing.request_id)
            message = f"kv_transfer_failed: the KV pages cannot land: {exc}"
            begun.errors[landing.request_id] = message
            continue
        if landing.starts_request:  # its first token was drawn where its prompt was computed
            sampler.skip_draw(landing.request_id)
