"""Border trimming: the ``trim_*`` resize policies first cut away uniform borders baked into an image.

A copy re-posted as a screenshot or letterboxed by another site carries a border of flat colour (often with
a bar of another flat colour across it) that the model would otherwise see as image. ``trim_box`` peels
flat lines off each side until none is left: a row (or column, over the rows still kept) is border when
almost all of its pixels are within ``tolerance`` of the line's median colour. Rows and columns alternate
until nothing changes, so a title bar in the top margin goes first, then the margin under it, then the side
margins. Real content rarely has a perfectly flat edge line; where it does (a flat sky, a product on a
white background), the same rule trims the original and its copies alike. Never trims more than
``max_fraction`` of either side, and an image with no flat border is returned unchanged.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

TOLERANCE = 12  # per channel, 0–255: JPEG noise on a flat border stays within it
FLAT_SHARE = 0.995  # share of a line's pixels that must be within the tolerance
MAX_FRACTION = 0.8  # at most this much of the height (width) is cut away


def _flat(lines: np.ndarray, tolerance: int, share: float) -> np.ndarray:
    """[n] bool: which of ``lines`` [n, L, 3] are flat (almost every pixel near the line's median)."""
    lines = lines.astype(np.int16)  # [n, L, 3]: differences of uint8 need a sign
    median = np.median(lines, axis=1, keepdims=True)  # [n, 1, 3]
    near = (np.abs(lines - median) <= tolerance).all(axis=-1)  # [n, L]
    return near.mean(axis=1) >= share


def _peel(lines: np.ndarray, tolerance: int, share: float, chunk: int = 16) -> tuple[int, int]:
    """(start, stop) of ``lines`` [n, L, 3] after moving start forward and stop back over flat lines; keeps at
    least one line. Only lines from the ends inward are examined, a chunk at a time, so an image without a
    border costs two chunks instead of a median over every line (213 ms for 1600x1200 before)."""
    n = lines.shape[0]
    start, stop = 0, n
    while start < stop - 1:
        end = min(start + chunk, stop - 1)
        flat = _flat(lines[start:end], tolerance, share)  # [end - start]
        if not flat.all():
            start += int(np.argmin(flat))
            break
        start = end
    while stop - 1 > start:
        begin = max(stop - chunk, start + 1)
        flat = _flat(lines[begin:stop], tolerance, share)[::-1]  # [stop - begin], from the end inward
        if not flat.all():
            stop -= int(np.argmin(flat))
            break
        stop = begin
    return start, stop


def trim_box(
    image: Image.Image,
    *,
    tolerance: int = TOLERANCE,
    share: float = FLAT_SHARE,
    max_fraction: float = MAX_FRACTION,
) -> tuple[int, int, int, int] | None:
    """(left, top, right, bottom) of ``image`` without its flat borders, or None when nothing is cut."""
    a = np.asarray(image if image.mode == "RGB" else image.convert("RGB"))  # [H, W, 3] uint8
    height, width = a.shape[:2]
    top, bottom, left, right = 0, height, 0, width
    for _ in range(8):  # alternate rows and columns until stable (a bar, then a margin, then the sides)
        before = (top, bottom, left, right)
        t, b = _peel(a[top:bottom, left:right], tolerance, share)
        top, bottom = top + t, top + b
        lft, rgt = _peel(a[top:bottom, left:right].transpose(1, 0, 2), tolerance, share)
        left, right = left + lft, left + rgt
        if (top, bottom, left, right) == before:
            break
    kept_h, kept_w = bottom - top, right - left
    if (kept_h, kept_w) == (height, width):
        return None
    if kept_h < (1 - max_fraction) * height or kept_w < (1 - max_fraction) * width or min(kept_h, kept_w) < 8:
        return None  # almost all flat: a blank or synthetic image, not a border around a picture
    return left, top, right, bottom


def trim_borders(image: Image.Image) -> Image.Image:
    """``image`` without its flat borders (the same object when it has none)."""
    box = trim_box(image)
    return image if box is None else image.crop(box)
