"""The C heap: temporaries that leave the process when freed, and free pages handed back.

Torch-free, so the HTTP front (which holds a tokenizer) uses it as the engine does.
"""

from __future__ import annotations

import ctypes
import sys

# Loading decodes each weight through temporaries of a few MB. glibc serves allocations above a
# threshold with their own mappings (returned on free), but it raises that threshold up to 32 MB
# after such a free, so later temporaries come from the heap, which keeps what they freed: on
# Qwen2.5-1.5B that held ~300 MB after the load (peak 2.08 GB RSS; with a fixed threshold 1.92).
_M_MMAP_THRESHOLD = -3  # <malloc.h>
_MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept fixed


def keep_large_allocations_unmappable() -> None:
    """Fix glibc's mmap threshold (no-op elsewhere) so freed temporaries leave the process."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)


def return_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # musl and others: nothing to tune
        return None
