"""Whole photographs for copy-detection set v2: Debian/Ubuntu wallpaper packages + the bundled photos.

``PHOTOS`` is the frozen list (chosen before any evaluation of set v2): every wallpaper in
``mate-backgrounds``' ``nature`` folder and every KDE Plasma wallpaper that is a photograph, plus the 10
colour photos bundled with scikit-image and scikit-learn (``quality.load_photos``). Rule, checked by eye on
a contact sheet of every image the five packages ship: a photograph of a real scene (camera noise, depth of
field, natural texture) is kept; vector art, gradients, renders, logos, textures and illustrations are not.
Left out that way: all of ``ukui-wallpapers``, ``gnome-backgrounds`` and ``lomiri-wallpapers`` (abstract or
vector), ``mate-backgrounds``' ``abstract`` and ``desktop`` folders, and the Plasma wallpapers Altai,
Autumn (painting), Canopee, Cascade, Cluster, ColorfulCups (3-D render), DarkestHour, Elarun, Flow,
FlyingKonqui, Honeywave, IceCold, Kay, Kokkini, Opal, PastelHills, Patak, SafeLanding, Shell.
One file per wallpaper: a Plasma wallpaper ships several sizes of one picture, the largest is used.

Where they come from: ``apt-get install mate-backgrounds plasma-workspace-wallpapers`` (then ``root`` is
``/``), or ``apt-get download`` the two packages and ``dpkg -x PACKAGE.deb DIR`` each into one DIR (then
``root`` is DIR). A missing photo raises an error naming its package.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

Image.MAX_IMAGE_PIXELS = 60_000_000  # the largest Plasma wallpapers are 5120x2880

MATE_NATURE = (
    "Aqua",
    "Blinds",
    "Dune",
    "FreshFlower",
    "Garden",
    "GreenMeadow",
    "LadyBird",
    "RainDrops",
    "Storm",
    "TwoWings",
    "Wood",
    "YellowFlower",
)
PLASMA_PHOTOS = (
    "BytheWater",
    "ColdRipple",
    "EveningGlow",
    "FallenLeaf",
    "Grey",
    "Kite",
    "MilkyWay",
    "OneStandsOut",
    "Path",
    "Volna",
    "summer_1am",
)
_SIZE = re.compile(r"^(\d+)x(\d+)\.(jpg|jpeg|png)$", re.IGNORECASE)


@dataclass(frozen=True)
class PhotoSource:
    name: str  # unique, e.g. "mate/Aqua", "plasma/Kite", "bundled/astronaut"
    package: str  # the apt package that ships it ("" for the bundled photos)


def sources(bundled: Iterable[str]) -> list[PhotoSource]:
    """Every photo of set v2 in a fixed order (the seeded split into originals and distractors uses it)."""
    return [
        *(PhotoSource(f"mate/{n}", "mate-backgrounds") for n in MATE_NATURE),
        *(PhotoSource(f"plasma/{n}", "plasma-workspace-wallpapers") for n in PLASMA_PHOTOS),
        *(PhotoSource(f"bundled/{n}", "") for n in sorted(bundled)),
    ]


def _plasma_file(root: Path, name: str) -> Path | None:
    """The largest ``WxH.ext`` in the wallpaper's ``contents/images`` (one picture at several sizes)."""
    folder = root / "usr/share/wallpapers" / name / "contents/images"
    if not folder.is_dir():
        return None
    sized = [(int(m[1]) * int(m[2]), p) for p in folder.iterdir() if (m := _SIZE.match(p.name))]
    return max(sized, key=lambda s: (s[0], s[1].name))[1] if sized else None


def photo_path(root: Path, source: PhotoSource) -> Path:
    kind, name = source.name.split("/", 1)
    path = (
        root / "usr/share/backgrounds/mate/nature" / f"{name}.jpg"
        if kind == "mate"
        else _plasma_file(root, name)
    )
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"photo {source.name!r} of copy set v2 not found under {root}: install the apt package "
            f"{source.package!r} (apt-get install {source.package}), or `apt-get download {source.package}` "
            f"and `dpkg -x {source.package}_*.deb DIR`, then pass --photos-root DIR"
        )
    return path


def load_v2_photos(root: Path, bundled: dict[str, np.ndarray]) -> dict[str, Image.Image]:
    """name → RGB image at full size, in ``sources()`` order; raises naming the package of a missing one.
    ``bundled``: the photos of scikit-image and scikit-learn (``quality.load_photos()``), [H, W, 3] uint8."""
    found = {s.name: photo_path(root, s) for s in sources(bundled) if s.package}  # all first: fail early
    out: dict[str, Image.Image] = {}
    for s in sources(bundled):
        if s.package:
            with Image.open(found[s.name]) as image:
                out[s.name] = image.convert("RGB")
        else:
            out[s.name] = Image.fromarray(np.ascontiguousarray(bundled[s.name.split("/", 1)[1]]))
    return out


def upload_size(image: Image.Image, long_side: int) -> Image.Image:
    """``image`` downscaled (Lanczos) so that its long side is ``long_side``; never upscaled."""
    scale = long_side / max(image.size)
    if scale >= 1:
        return image
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.LANCZOS)


def halves(image: Image.Image) -> list[Image.Image]:
    """The two non-overlapping halves of ``image``, cut across its long side."""
    w, h = image.size
    if w >= h:
        return [image.crop((0, 0, w // 2, h)), image.crop((w // 2, 0, w, h))]
    return [image.crop((0, 0, w, h // 2)), image.crop((0, h // 2, w, h))]
