"""Border trimming examines lines from the edges inward only; the box must equal the rule applied to every
line (the reference below: flat lines computed for the whole image, then peeled), on random images with
random flat borders, noise and modes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vit_backbone.borders import FLAT_SHARE, MAX_FRACTION, TOLERANCE, trim_box


def reference_box(image: Image.Image) -> tuple[int, int, int, int] | None:
    a = np.asarray(image.convert("RGB"), dtype=np.int16)  # [H, W, 3]

    def flat(lines: np.ndarray) -> np.ndarray:
        median = np.median(lines, axis=1, keepdims=True)  # [n, 1, 3]
        return (np.abs(lines - median) <= TOLERANCE).all(axis=-1).mean(axis=1) >= FLAT_SHARE

    def peel(flags: np.ndarray) -> tuple[int, int]:
        start, stop = 0, len(flags)
        while start < stop - 1 and flags[start]:
            start += 1
        while stop - 1 > start and flags[stop - 1]:
            stop -= 1
        return start, stop

    height, width = a.shape[:2]
    top, bottom, left, right = 0, height, 0, width
    for _ in range(8):
        before = (top, bottom, left, right)
        t, b = peel(flat(a[top:bottom, left:right]))
        top, bottom = top + t, top + b
        lft, rgt = peel(flat(a[top:bottom, left:right].transpose(1, 0, 2)))
        left, right = left + lft, left + rgt
        if (top, bottom, left, right) == before:
            break
    kept_h, kept_w = bottom - top, right - left
    if (kept_h, kept_w) == (height, width):
        return None
    if kept_h < (1 - MAX_FRACTION) * height or kept_w < (1 - MAX_FRACTION) * width or min(kept_h, kept_w) < 8:
        return None
    return left, top, right, bottom


def random_image(rng: np.random.Generator) -> Image.Image:
    h, w = (int(v) for v in rng.integers(12, 120, size=2))
    if rng.random() < 0.7:
        a = rng.integers(0, 256, size=(h, w, 3)).astype(np.uint8)
    else:
        a = np.full((h, w, 3), rng.integers(0, 256), np.uint8)
    for _ in range(int(rng.integers(0, 5))):
        side, k = int(rng.integers(0, 4)), int(rng.integers(1, max(2, min(h, w) // 2)))
        colour = rng.integers(0, 256, size=3)
        if side == 0:
            a[:k] = colour
        elif side == 1:
            a[-k:] = colour
        elif side == 2:
            a[:, :k] = colour
        else:
            a[:, -k:] = colour
    if rng.random() < 0.4:
        a = np.clip(a.astype(int) + rng.integers(-14, 15, size=a.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(a)
    return image.convert("L") if rng.random() < 0.2 else image


@pytest.mark.parametrize("seed", range(4))
def test_trim_box_equals_the_rule_applied_to_every_line(seed: int) -> None:
    rng = np.random.default_rng(seed)
    images = [random_image(rng) for _ in range(150)]
    boxes = [trim_box(image) for image in images]
    assert boxes == [reference_box(image) for image in images]
    assert sum(box is not None for box in boxes) > 20  # the borders were found, not only skipped


def test_a_letterboxed_photo_is_cut_to_the_photo() -> None:
    rng = np.random.default_rng(7)
    photo = rng.integers(0, 256, size=(800, 1000, 3)).astype(np.uint8)
    canvas = np.full((1200, 1600, 3), 30, np.uint8)
    canvas[200:1000, 300:1300] = photo
    assert trim_box(Image.fromarray(canvas)) == (300, 200, 1300, 1000)
