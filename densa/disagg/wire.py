"""K/V pages <-> wire frames: packed on one worker (densa/worker/kv_io.py), framed and checked here.

The source sends pages in its own KV format (densa.formats.kv_format), never re-encoded: the
header's WireLayout names the format, and the raw frames after it are the packed buffers:

    format                    frame 1          frame 2                  in the header
    float32/bfloat16/float16  the values       -                        -
    fp8_e4m3, dynamic         e4m3 bytes       int8 exponent per row    -
    fp8_e4m3, static          e4m3 bytes       -                        per-layer K and V scales
    int8                      int8 codes       fp16 scale per row       -

(a row: one token's head_dim values of one head, K or V). What the frames must hold is computed
from the format named, never guessed from their sizes; landing converts between any two formats
(kv_io.land, applied by the decode worker's runner). Sparse attention's index keys follow as
frames of their own layout (WireLayout.index), in their own format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from densa.disagg.messages import KVPages, MTPState, WireLayout
from densa.formats.kv_format import KVFormat
from densa.model.kv_layout import LayerCache
from densa.sched.output import PackedPages
from densa.worker import kv_io

NUM_DIMS = 6  # [num_layers, 2 (K, V), num_pages, num_kv_heads, page_size, head_dim]


class WireError(ValueError):
    """The frames do not match their layout (truncated, corrupted, or another format)."""


@dataclass(frozen=True)
class Packed:
    layout: WireLayout
    frames: list[memoryview]  # raw buffers: values, then per-row scales (if the format has them)
    mtp: MTPState | None = None  # set: the MTP state's frames follow the pages' (messages.py)

    @property
    def num_bytes(self) -> int:
        return sum(frame.nbytes for frame in self.frames)


def pack_pages(caches: Sequence[LayerCache], page_ids: list[int]) -> Packed:
    """Copy pages out of the cache, all layers, K and V (and index keys), in its own format,
    framed (an engine's pages are copied out by its runner, in a step: `framed`)."""
    return framed(kv_io.pack(caches, page_ids))


def framed(pages: PackedPages) -> Packed:
    """Packed pages as the frames they travel in."""
    layout, frames = _framed(pages)
    return Packed(layout, frames)


def _framed(pages: PackedPages) -> tuple[WireLayout, list[memoryview]]:
    frames = [pages.values] + ([] if pages.row_scales is None else [pages.row_scales])
    index = None
    if pages.index is not None:
        index, index_frames = _framed(pages.index)
        frames += index_frames
    layout = WireLayout(
        kv_dtype=pages.kv_dtype,
        kv_scales=pages.kv_scales,
        shape=list(pages.shape),
        static_scales=pages.static_scales,
        index=index,
    )
    return layout, frames


def num_frames(layout: WireLayout) -> int:
    """Frames the layout's pages travel as (their index keys' included)."""
    own = len(frame_sizes(layout_format(layout), [1] * NUM_DIMS))
    return own + (0 if layout.index is None else num_frames(layout.index))


def with_mtp_state(
    packed: Packed, mtp_pages: PackedPages, num_positions: int, hidden: bytes
) -> Packed:
    """`packed` plus the MTP layer's pages (positions [0, num_positions)) and h of the last
    prompt position (float32 bytes), framed after the target's pages."""
    pages = framed(mtp_pages)
    state = MTPState(pages.layout, num_positions)
    return Packed(packed.layout, [*packed.frames, *pages.frames, memoryview(hidden)], state)


@dataclass(frozen=True)
class Frames:
    """A KVPages message's frames, split by what they hold."""

    pages: list[memoryview]
    mtp_pages: list[memoryview]  # [] without an MTP state
    mtp_hidden: memoryview | None


def split_frames(message: KVPages, frames: list[memoryview]) -> Frames:
    """Which frames are the target's pages and which the MTP state's, as the layouts say (the
    sizes are checked after: check_frames); WireError if their number is not what they say."""
    num_pages_frames = num_frames(message.layout)
    num_mtp = 0 if message.mtp is None else num_frames(message.mtp.layout) + 1
    if len(frames) != num_pages_frames + num_mtp:
        raise WireError(f"{len(frames)} frames, expected {num_pages_frames + num_mtp}")
    rest = frames[num_pages_frames:]
    return Frames(frames[:num_pages_frames], rest[:-1], rest[-1] if rest else None)


def check_frames(layout: WireLayout, frames: list[memoryview], num_pages: int) -> None:
    """Raise WireError unless the frames are exactly what the layout announces. (Damage in
    flight is caught before this, by the message's MAC: densa/auth/frames.py.)"""
    kv_format = layout_format(layout)
    shape = layout.shape
    if len(shape) != NUM_DIMS or shape[2] != num_pages or min(shape) < 0:
        raise WireError(f"a layout of {layout.kv_dtype} {shape} for {num_pages} pages")
    sizes = frame_sizes(kv_format, shape)
    if layout.index is not None:
        check_frames(layout.index, frames[len(sizes) :], num_pages)
        frames = frames[: len(sizes)]
    if [f.nbytes for f in frames] != sizes:
        raise WireError(f"frames of {[f.nbytes for f in frames]} bytes, expected {sizes}")
    num_static = [len(s) for s in layout.static_scales]
    if num_static != ([shape[1]] * shape[0] if kv_format.has_layer_scales else []):
        raise WireError(f"static scales for {num_static} parts in a layout of {shape}")


def layout_format(layout: WireLayout) -> KVFormat:
    try:
        return KVFormat.from_wire(layout.kv_dtype, layout.kv_scales)
    except ValueError as exc:
        raise WireError(f"pages of an unknown KV format: {exc}") from exc


def frame_sizes(kv_format: KVFormat, shape: list[int]) -> list[int]:
    """Bytes of each frame that pages of `shape` in `kv_format` travel as."""
    num_rows = 1
    for size in shape[:-1]:
        num_rows *= size
    sizes = [num_rows * shape[-1] * kv_format.value_bytes()]
    if kv_format.row_scale_dtype is not None:
        sizes.append(num_rows * kv_format.scale_bytes_per_row())
    return sizes


def unpack(layout: WireLayout, frames: list[memoryview]) -> PackedPages:
    """Checked frames (check_frames) as the packed pages a runner lands."""
    own = len(frame_sizes(layout_format(layout), [1] * NUM_DIMS))
    row_scales = frames[1] if own > 1 else None
    index = None if layout.index is None else unpack(layout.index, frames[own:])
    return PackedPages(
        layout.kv_dtype, layout.kv_scales, tuple(layout.shape), frames[0], row_scales,
        layout.static_scales, index,
    )  # fmt: skip
