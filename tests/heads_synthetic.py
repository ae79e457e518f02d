"""Generated data for the frozen-head tests: labelled folders whose classes differ visibly (colour and
shape), and segmentation folders of coloured shapes on a textured background with exact masks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("blue_square", "green_triangle", "red_circle")  # sorted: the folder reader's class order
_COLOURS = {"red_circle": (220, 30, 30), "blue_square": (30, 60, 220), "green_triangle": (30, 200, 40)}
SEG_CLASSES = ("background", "red_square", "blue_disc")
_SEG_COLOURS = {1: (220, 30, 30), 2: (30, 60, 220)}


def _background(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    grey = rng.integers(90, 170)
    noise = rng.integers(-25, 26, size=(height, width, 1))
    pixels = np.clip(grey + noise, 0, 255).repeat(3, axis=2).astype(np.uint8)
    return Image.fromarray(pixels)


def _draw(
    draw: ImageDraw.ImageDraw, kind: str, box: tuple[int, int, int, int], fill: tuple[int, ...]
) -> None:
    left, top, right, bottom = box
    if kind.endswith("circle") or kind.endswith("disc"):
        draw.ellipse(box, fill=fill)
    elif kind.endswith("triangle"):
        draw.polygon([((left + right) // 2, top), (left, bottom), (right, bottom)], fill=fill)
    else:
        draw.rectangle(box, fill=fill)


def labelled_image(label: str, seed: int, size: int = 64) -> Image.Image:
    rng = np.random.default_rng(seed)
    image = _background(rng, size, size)
    side = int(rng.integers(size // 2, size - 8))
    left, top = (int(v) for v in rng.integers(0, size - side, size=2))
    _draw(ImageDraw.Draw(image), label, (left, top, left + side, top + side), _COLOURS[label])
    return image


def make_labelled_folder(root: Path, per_class: int = 10, *, seed: int = 0, size: int = 64) -> Path:
    """``root/<class>/<i>.png`` for the three CLASSES."""
    for c, label in enumerate(CLASSES):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            labelled_image(label, seed * 100_000 + c * 1000 + i, size).save(root / label / f"{i:03d}.png")
    return root


def segmentation_pair(seed: int, height: int = 112, width: int = 112) -> tuple[Image.Image, np.ndarray]:
    """An image with one red square and one blue disc on a textured background, and its exact mask."""
    rng = np.random.default_rng(seed)
    image = _background(rng, height, width)
    mask = Image.new("L", (width, height), 0)
    for cls in (1, 2):
        side = int(rng.integers(min(height, width) // 4, min(height, width) // 2))
        left = int(rng.integers(0, width - side))
        top = int(rng.integers(0, height - side))
        box = (left, top, left + side, top + side)
        kind = SEG_CLASSES[cls]
        _draw(ImageDraw.Draw(image), kind, box, _SEG_COLOURS[cls])
        _draw(ImageDraw.Draw(mask), kind, box, (cls,))
    return image, np.asarray(mask, dtype=np.int64)


def make_segmentation_folder(
    root: Path, count: int = 24, *, seed: int = 0, names: bool = True, size: tuple[int, int] = (112, 112)
) -> Path:
    """``root/<i>.png`` + ``root/<i>.mask.png`` (``size`` = (H, W)) and ``classes.txt``."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        image, mask = segmentation_pair(seed * 100_000 + i, *size)
        image.save(root / f"{i:03d}.png")
        Image.fromarray(mask.astype(np.uint8), mode="L").save(root / f"{i:03d}.mask.png")
    if names:
        (root / "classes.txt").write_text("\n".join(SEG_CLASSES) + "\n")
    return root
