"""Copy set v2's photo loader (bench/common/wallpapers.py): where photos are looked for, the error that
names the package of a missing one, the largest-size rule for Plasma wallpapers, upload sizes, halves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.common.wallpapers import (
    MATE_NATURE,
    PLASMA_PHOTOS,
    PhotoSource,
    halves,
    load_v2_photos,
    photo_path,
    sources,
    upload_size,
)


def _save(path: Path, size: tuple[int, int], value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value, value)).save(path)


def test_a_missing_photo_names_its_apt_package(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install mate-backgrounds"):
        photo_path(tmp_path, PhotoSource("mate/Aqua", "mate-backgrounds"))
    for name in MATE_NATURE:  # the mate photos are there, the Plasma ones are not
        _save(tmp_path / "usr/share/backgrounds/mate/nature" / f"{name}.jpg", (8, 8), 0)
    with pytest.raises(FileNotFoundError, match="apt-get install plasma-workspace-wallpapers") as caught:
        load_v2_photos(tmp_path, {})
    assert "--photos-root" in str(caught.value) and "'plasma/BytheWater'" in str(caught.value)


def test_plasma_takes_the_largest_size_and_mate_its_jpeg(tmp_path: Path) -> None:
    images = tmp_path / "usr/share/wallpapers/Kite/contents/images"
    for name, value in (("1920x1080.jpg", 10), ("5120x2880.png", 20), ("720x1440.jpg", 30)):
        _save(images / name, (8, 8), value)
    (images / "notes.txt").write_text("not an image size")
    found = photo_path(tmp_path, PhotoSource("plasma/Kite", "plasma-workspace-wallpapers"))
    assert found == images / "5120x2880.png"
    _save(tmp_path / "usr/share/backgrounds/mate/nature/Aqua.jpg", (8, 8), 0)
    aqua = photo_path(tmp_path, PhotoSource("mate/Aqua", "mate-backgrounds"))
    assert aqua.name == "Aqua.jpg"


def test_every_photo_loads_from_one_root_in_a_fixed_order(tmp_path: Path) -> None:
    for k, name in enumerate(MATE_NATURE):
        _save(tmp_path / "usr/share/backgrounds/mate/nature" / f"{name}.jpg", (12, 10), k)
    for k, name in enumerate(PLASMA_PHOTOS):
        _save(tmp_path / "usr/share/wallpapers" / name / "contents/images/16x10.png", (16, 10), 100 + k)
    Image.new("L", (16, 10), 7).save(tmp_path / "usr/share/wallpapers/Grey/contents/images/16x10.png")  # grey
    bundled = {"coffee": np.full((4, 6, 3), 200, np.uint8)}
    photos = load_v2_photos(tmp_path, bundled)
    assert list(photos) == [s.name for s in sources(bundled)]
    assert len(photos) == len(MATE_NATURE) + len(PLASMA_PHOTOS) + 1
    assert all(p.mode == "RGB" for p in photos.values())
    assert photos["plasma/Grey"].getpixel((0, 0)) == (7, 7, 7)
    assert photos["plasma/Kite"].size == (16, 10)
    assert photos["bundled/coffee"].size == (6, 4)


def test_upload_size_only_downscales_and_halves_split_the_long_side() -> None:
    image = Image.new("RGB", (2000, 1000))
    assert upload_size(image, 800).size == (800, 400)
    assert upload_size(image, 4000) is image
    left, right = halves(Image.new("RGB", (801, 400)))
    assert (left.size, right.size) == ((400, 400), (401, 400))
    top, bottom = halves(Image.new("RGB", (300, 600)))
    assert (top.size, bottom.size) == ((300, 300), (300, 300))
