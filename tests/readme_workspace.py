"""The folder tests/test_readme.py runs the README's snippets in: the files a reader brings (a photo folder,
product manifests, labelled folders, a local checkpoint), made small, plus the repository's examples/ and
client/ as in a clone. What each file is for is named where it is made; the README's sample outputs (the
heads' "24 images (3 classes)", the search hit `sku-042`) are what these files give."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from heads_synthetic import make_labelled_folder, make_segmentation_folder
from PIL import Image

# Product photos: the coffee product is a crop of the sample photo the README queries with
# (examples/coffee.jpg), so the search snippets' first hit is sku-042, close to but not exactly the query.
PRODUCTS = [  # id, image, brand
    ("sku-042", "coffee-cup.jpg", "acme"),
    ("sku-007", "cat.jpg", "acme"),
    ("sku-123", "astronaut.jpg", "old"),
    ("sku-456", "rocket.jpg", "old"),
]
NEW_PRODUCTS = [  # a later batch: one new row, one update of an existing id
    ("sku-500", "chelsea.jpg", "acme"),
    ("sku-007", "cat.jpg", "acme"),
]
SHAPES_PER_CLASS = 10  # 3 x 10 images: "trained a linear head on 24 images", 6 held out (the README's output)


def _crop(image: Image.Image, fraction: float) -> Image.Image:
    width, height = image.size
    dx, dy = int(width * (1 - fraction) / 2), int(height * (1 - fraction) / 2)
    return image.crop((dx, dy, width - dx, height - dy))


def _skimage_photo(name: str, width: int = 320) -> Image.Image:
    from skimage import data

    image = Image.fromarray(getattr(data, name)()).convert("RGB")
    return image.resize((width, round(image.height * width / image.width)))


def _write_manifest(path: Path, rows: list[tuple[str, str, str]], header: tuple[str, str, str]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


def make_readme_workspace(root: Path, repo: Path, embedded_dir: Path, dinov2: Path) -> Path:
    """Fill ``root`` (returned) with every input the README's runnable snippets name."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "examples").symlink_to(repo / "examples")  # the sample photos, as in a clone
    (root / "client").symlink_to(repo / "client")  # `pip install ./client`
    cache = (
        root / "home" / ".cache" / "vitembed"
    )  # HOME for the snippets: ~/.cache/vitembed/features lands here
    cache.mkdir(parents=True)
    (cache / "embedded").symlink_to(
        embedded_dir.parent
    )  # the converted embedded checkpoint, not converted again

    cat, coffee = (Image.open(repo / "examples" / f"{name}.jpg").convert("RGB") for name in ("cat", "coffee"))
    photos = root / "photos"  # "a folder of your images" (the overview, Catalogs)
    photos.mkdir()
    cat.save(photos / "cat.jpg", quality=90)
    coffee.save(photos / "coffee.jpg", quality=90)
    _skimage_photo("astronaut").save(photos / "astronaut.jpg", quality=90)

    images = root / "images"  # the product manifests' photos (paths relative to the manifests)
    images.mkdir()
    _crop(coffee, 0.85).save(images / "coffee-cup.jpg", quality=90)
    _crop(cat, 0.9).save(images / "cat.jpg", quality=90)
    for name in ("astronaut", "rocket", "chelsea"):
        _skimage_photo(name).save(images / f"{name}.jpg", quality=90)
    header = ("id", "path", "brand")
    _write_manifest(root / "products.csv", [(i, f"images/{f}", b) for i, f, b in PRODUCTS], header)
    _write_manifest(root / "new-products.csv", [(i, f"images/{f}", b) for i, f, b in NEW_PRODUCTS], header)

    make_labelled_folder(root / "shapes", per_class=SHAPES_PER_CLASS, seed=0)  # heads train --data shapes/
    make_labelled_folder(root / "labelled", per_class=4, seed=1)  # the overview's --data labelled/
    make_segmentation_folder(root / "scenes", count=6, seed=2)  # --kind patch: x.png + x.mask.png
    kinds = sorted((root / "labelled").glob("*/*.png"))  # kinds.csv: a manifest with a label column
    _write_manifest(
        root / "kinds.csv",
        [(f"kind-{i:02d}", str(p.relative_to(root)), p.parent.name) for i, p in enumerate(kinds)],
        ("id", "path", "label"),
    )

    shutil.copytree(dinov2, root / "models" / "dinov2-small")  # a tiny random-init DINOv2 for `--model dino=`
    return root
