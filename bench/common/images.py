"""Test JPEGs for the benches, made locally (no downloads).

- photos: the colour photographs bundled with scikit-image (and two with scikit-learn), cover-cropped to the
  target aspect ratio, resized (Lanczos) and saved as quality-90 JPEGs: what a user's catalog looks like;
- noise: uniform random pixels, the worst case for JPEG entropy decoding (files several times larger);
- varied photos: ``count`` distinct copies (own crop offset, mirror, mild grain) for jobs over many files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

JPEG_QUALITY = 90
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")


@dataclass(frozen=True)
class JpegSet:
    """One set of test files: ``label`` names it in reports (e.g. ``photos 1600x1200``)."""

    label: str
    kind: str  # "photos" | "noise"
    width: int
    height: int
    paths: tuple[Path, ...]

    def bodies(self) -> list[bytes]:
        return [path.read_bytes() for path in self.paths]

    def facts(self) -> dict[str, object]:
        """What a report says about the files."""
        sizes = [path.stat().st_size for path in self.paths]
        return {
            "kind": self.kind,
            "size": f"{self.width}x{self.height}",
            "count": len(self.paths),
            "mean_kb": float(np.mean(sizes)) / 1024 if sizes else float("nan"),
            "sizes_kb": [round(size / 1024) for size in sizes],
            "names": [path.stem for path in self.paths],
            "quality": JPEG_QUALITY,
        }


def load_photos() -> dict[str, np.ndarray]:
    """Colour photographs shipped inside scikit-image and scikit-learn: name → [H, W, 3] uint8."""
    try:
        import skimage.data as skd
        from sklearn.datasets import load_sample_images
    except ImportError as exc:  # the benches' photos come from the eval extra
        raise RuntimeError(
            "the bench photos need scikit-image and scikit-learn: pip install 'vitembed[eval]'"
        ) from exc

    photos: dict[str, np.ndarray] = {name: np.asarray(getattr(skd, name)()) for name in SKIMAGE_PHOTOS}
    left, right, _ = skd.stereo_motorcycle()
    photos["motorcycle_left"] = np.asarray(left)
    photos["motorcycle_right"] = np.asarray(right)
    sample = load_sample_images()
    for filename, array in zip(sample.filenames, sample.images, strict=True):
        photos[Path(filename).stem] = np.asarray(array)  # china, flower
    return {name: np.ascontiguousarray(a[..., :3]) for name, a in photos.items()}  # [H, W, 3]


def cover_resize(array: np.ndarray, width: int, height: int) -> Image.Image:
    """Center-crop [H, W, 3] to the target aspect ratio, then resize (Lanczos) to exactly width x height."""
    h, w = array.shape[:2]
    if w * height > h * width:  # too wide
        new_w = h * width // height
        left = (w - new_w) // 2
        array = array[:, left : left + new_w]
    else:
        new_h = w * height // width
        top = (h - new_h) // 2
        array = array[top : top + new_h]
    return Image.fromarray(array).resize((width, height), Image.Resampling.LANCZOS)


def _save(image: Image.Image, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, "JPEG", quality=JPEG_QUALITY, optimize=False)
    return path


def photo_jpegs(folder: Path, width: int, height: int, count: int | None = None) -> JpegSet:
    """The bundled photos (all, or the first ``count``) at width x height, as quality-90 JPEGs."""
    photos = list(load_photos().items())[:count]
    paths = tuple(
        _save(cover_resize(array, width, height), folder / f"photo_{name}_{width}x{height}.jpg")
        for name, array in photos
    )
    return JpegSet(f"photos {width}x{height}", "photos", width, height, paths)


def noise_jpegs(folder: Path, width: int, height: int, count: int, seed: int = 0) -> JpegSet:
    """``count`` JPEGs of uniform random pixels: the slowest content to entropy-decode."""
    rng = np.random.default_rng(seed)
    paths = tuple(
        _save(
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)),  # [H, W, 3]
            folder / f"noise_{n:02d}_{width}x{height}.jpg",
        )
        for n in range(count)
    )
    return JpegSet(f"noise {width}x{height}", "noise", width, height, paths)


def varied_photo_jpegs(
    folder: Path, count: int, width: int, height: int, *, grain: float = 6.0, seed: int = 0
) -> list[Path]:
    """``count`` distinct JPEGs: each a photo cropped at its own offset, maybe mirrored, with Gaussian grain
    (sigma in 8-bit levels) so no two files are equal; 60 per sub-folder, as a catalog folder tree."""
    rng = np.random.default_rng(seed)
    photos = list(load_photos().values())
    paths = []
    for n in range(count):
        array = photos[n % len(photos)]
        h, w = array.shape[:2]
        top, left = int(rng.integers(0, max(1, h // 8))), int(rng.integers(0, max(1, w // 8)))
        image = cover_resize(np.ascontiguousarray(array[top:, left:]), width, height)
        pixels = np.asarray(image, dtype=np.float32)  # [H, W, 3]
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        pixels = pixels + rng.normal(0.0, grain, size=pixels.shape).astype(np.float32)
        path = folder / f"{n // 60:02d}" / f"img-{n:04d}.jpg"
        paths.append(_save(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)), path))
    return paths
