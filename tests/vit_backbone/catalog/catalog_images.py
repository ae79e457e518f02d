"""A generated image tree for catalog tests: real JPEG/PNG files of varied sizes in nested folders, and
broken files whose errors.jsonl codes are known in advance."""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class ImageTree:
    root: Path
    good: list[str]  # ids (POSIX paths relative to root) of the decodable images, sorted
    bad: dict[str, str]  # id -> expected errors.jsonl code


def picture(seed: int, height: int, width: int) -> Image.Image:
    """A smooth random picture (gradients + blobs + noise): distinct per seed, JPEG-friendly."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    channels = []
    for _ in range(3):
        a, b, c = rng.uniform(-3, 3, size=3)
        channels.append(np.sin(a * xx * 6 + b * yy * 6 + c) * 0.5 + 0.5)
    base = np.stack(channels, -1) * 200 + rng.integers(0, 40, size=(height, width, 3))
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height pixels (a decompression bomb's signature)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


GOOD_LAYOUT = [  # (relative path, height, width)
    ("a/cat.jpg", 120, 160),
    ("a/dog.png", 90, 90),
    ("a/b/deep.jpg", 200, 80),
    ("a/b/deeper.JPG", 64, 256),
    ("a/b/c/x.png", 150, 100),
    ("c/one.jpeg", 333, 222),
    ("c/two.png", 48, 60),
    ("c/three.jpg", 400, 300),
    ("d/wide.jpg", 100, 700),
    ("d/tall.png", 500, 120),
    ("e.jpg", 77, 99),
    ("f.png", 256, 256),
]


def make_image_tree(root: Path, *, copies: int = 1) -> ImageTree:
    """``copies`` repeats the good layout under ``more-{k}/`` to make a larger tree."""
    root.mkdir(parents=True, exist_ok=True)
    good = []
    seed = 0
    for k in range(copies):
        prefix = "" if k == 0 else f"more-{k}/"
        for rel, height, width in GOOD_LAYOUT:
            path = root / f"{prefix}{rel}"
            path.parent.mkdir(parents=True, exist_ok=True)
            fmt = "PNG" if rel.lower().endswith(".png") else "JPEG"
            path.write_bytes(encode(picture(seed, height, width), fmt))
            good.append(f"{prefix}{rel}")
            seed += 1
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    jpeg = encode(picture(999, 240, 320), "JPEG")
    (broken / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (broken / "not_image.png").write_bytes(b"this is not an image, just some text\n" * 10)
    (broken / "empty.jpg").write_bytes(b"")
    (broken / "bomb.png").write_bytes(png_bomb(100_000, 100_000))
    (root / "notes.txt").write_text("not an image extension: must be ignored\n")
    (root / "a" / "README").write_text("no extension: ignored\n")
    bad = {
        "broken/truncated.jpg": "truncated",
        "broken/not_image.png": "not_an_image",
        "broken/empty.jpg": "empty",
        "broken/bomb.png": "too_many_pixels",
    }
    return ImageTree(root=root, good=sorted(good), bad=bad)
