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
    median = np.median(lines, axis=1, keepdims=True)  # [n, 1, 3]
    near = (np.abs(lines - median) <= tolerance).all(axis=-1)  # [n, L]
    return near.mean(axis=1) >= share


def _peel(flat: np.ndarray, start: int, stop: int) -> tuple[int, int]:
    """Move ``start`` forward and ``stop`` back over flat lines; keeps at least one line."""
    while start < stop - 1 and flat[start]:
        start += 1
    while stop - 1 > start and flat[stop - 1]:
        stop -= 1
    return start, stop


def trim_box(
    image: Image.Image,
    *,
    tolerance: int = TOLERANCE,
    share: float = FLAT_SHARE,
    max_fraction: float = MAX_FRACTION,
) -> tuple[int, int, int, int] | None:
    """(left, top, right, bottom) of ``image`` without its flat borders, or None when nothing is cut."""
    a = np.asarray(image.convert("RGB"), dtype=np.int16)  # [H, W, 3]
    height, width = a.shape[:2]
    top, bottom, left, right = 0, height, 0, width
    for _ in range(8):  # alternate rows and columns until stable (a bar, then a margin, then the sides)
        before = (top, bottom, left, right)
        rows = _flat(a[top:bottom, left:right], tolerance, share)  # [bottom - top]
        t, b = _peel(rows, 0, bottom - top)
        top, bottom = top + t, top + b
        cols = _flat(a[top:bottom, left:right].transpose(1, 0, 2), tolerance, share)  # [right - left]
        lft, rgt = _peel(cols, 0, right - left)
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
