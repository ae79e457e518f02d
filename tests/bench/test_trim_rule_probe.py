"""The trim-rule probe's rules (bench/trim_rule_probe.py) on images whose borders are known."""

from __future__ import annotations

import numpy as np
from PIL import Image

from bench.trim_rule_probe import frame_fill, rule_box


def _noise(width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(40, 216, size=(height, width, 3), dtype=np.uint8)


def test_framed_trims_a_picture_in_a_frame() -> None:
    canvas = np.zeros((120, 160, 3), np.uint8)  # a black frame: 20 px top/bottom, 30 px left/right
    canvas[20:100, 30:130] = _noise(100, 80, 0)
    image = Image.fromarray(canvas)
    assert frame_fill(image, (30, 20, 130, 100)) > 0.95
    assert rule_box(image, "framed", 0.8) == (30, 20, 130, 100)


def test_framed_leaves_an_object_on_a_flat_background_whole() -> None:
    canvas = np.full((120, 120, 3), 255, np.uint8)  # a white studio background
    yy, xx = np.mgrid[:120, :120]
    disc = (yy - 60) ** 2 + (xx - 60) ** 2 <= 40**2  # a round product touching its box at four points
    canvas[disc] = _noise(120, 120, 1)[disc]
    image = Image.fromarray(canvas)
    box = (20, 20, 101, 101)
    assert rule_box(image, "wide", 0.0) == box  # today's rule cuts the background away
    assert frame_fill(image, box) < 0.3
    assert rule_box(image, "framed", 0.8) is None


def test_tiny_keeps_small_images_whole() -> None:
    canvas = np.zeros((28, 28, 3), np.uint8)
    canvas[4:24, 6:22] = _noise(16, 20, 2)
    image = Image.fromarray(canvas)
    assert rule_box(image, "tiny", 20) == (6, 4, 22, 24)
    assert rule_box(image, "tiny", 32) is None
