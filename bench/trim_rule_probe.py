"""Probe another border-trim rule for ``trim_squash`` without re-running the whole copy bench.

Only the items whose trim box changes under the rule get a new forward; every other row is taken from the
cached ``trim_squash`` features that ``bench/copy_detection.py`` wrote (``--cache``: ``trim_squash.npz``
for set v1, ``v2-trim_squash.npz`` for v2, ``fashion-1000-2000-trim_squash.npz`` for Fashion-MNIST), so a
probe costs the changed items' forwards. Rules (``--param``):

- ``tiny``: no trim when the image's short side is under PARAM px;
- ``margin``: keep PARAM × the kept size of border on each trimmed side;
- ``wide``: trim a side only when its flat border is at least PARAM of that dimension;
- ``framed``: trim only when the picture fills every cut side: just inside each cut side (a band of 3 % of
  that dimension, at least 1 px) some line has at least PARAM of its pixels unlike the border next to it.
  A frame around a rectangular picture passes; an object on a flat background (a product shot, a
  Fashion-MNIST item) touches its bounding box only at its extremes and is left whole.

    python bench/trim_rule_probe.py --rule margin --param 0.1 --set fashion --cache DIR

A probe, not a policy: the library's ``trim_squash`` is unchanged (README, "Copy detection on harder copies").
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import copy_detection as cd

import vit_backbone.preprocess as preprocess
from vit_backbone import borders, load_backbone

Box = tuple[int, int, int, int]


def rule_box(image: Image.Image, rule: str, param: float) -> Box | None:
    box = borders.trim_box(image)
    if box is None:
        return None
    w, h = image.size
    left, top, right, bottom = box
    if rule == "tiny":
        return None if min(w, h) < param else box
    if rule == "framed":
        return box if frame_fill(image, box) >= param else None
    if rule == "margin":
        mx, my = round(param * (right - left)), round(param * (bottom - top))
        out = (max(0, left - mx), max(0, top - my), min(w, right + mx), min(h, bottom + my))
    elif rule == "wide":
        out = (
            left if left >= param * w else 0,
            top if top >= param * h else 0,
            right if w - right >= param * w else w,
            bottom if h - bottom >= param * h else h,
        )
    else:
        raise ValueError(f"unknown rule {rule!r}: tiny, margin, wide or framed")
    return None if out == (0, 0, w, h) else out


FILL_TOLERANCE = 24  # per channel: a pixel this close to the border's colour is border, not picture


def frame_fill(image: Image.Image, box: Box) -> float:
    """The least, over the cut sides of ``box``, of how much of the picture's edge line differs from the
    border next to it (the best line of a band 3 % deep inside that side): 1.0 for a picture in a frame."""
    a = np.asarray(image.convert("RGB")).astype(np.int16)  # [H, W, 3]
    h, w = a.shape[:2]
    left, top, right, bottom = box
    inner = a[top:bottom, left:right]  # [h', w', 3]
    fills = []
    sides = (
        (top > 0, a[top - 1, left:right], inner, bottom - top),  # the line above the box, rows from the top
        (bottom < h, a[min(bottom, h - 1), left:right], inner[::-1], bottom - top),
        (left > 0, a[top:bottom, left - 1], inner.transpose(1, 0, 2), right - left),
        (right < w, a[top:bottom, min(right, w - 1)], inner.transpose(1, 0, 2)[::-1], right - left),
    )
    for cut, border, lines, size in sides:
        if not cut:
            continue
        depth = max(1, round(0.03 * size))
        colour = np.median(border, axis=0)  # [3]
        unlike = (np.abs(lines[:depth] - colour) > FILL_TOLERANCE).any(axis=-1)  # [depth, L]
        fills.append(float(unlike.mean(axis=1).max()))
    return min(fills) if fills else 1.0


def _rgb(item: Image.Image | bytes) -> Image.Image:
    return (Image.open(io.BytesIO(item)) if isinstance(item, bytes) else item).convert("RGB")


def probe(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.set == "fashion":
        from quality import load_fashion

        fashion = load_fashion(1000, 2000, 0)
        items: list[Image.Image | bytes] = list(fashion.pil())
        cache = args.cache / "fashion-1000-2000-trim_squash.npz"
    else:
        config = json.loads(cd.CONFIGS[args.set].read_text())
        v2 = args.set == "v2"
        data = cd.make_set_v2(config, False, args.photos_root) if v2 else cd.make_set(config, False)
        items = data.items
        cache = args.cache / ("v2-trim_squash.npz" if v2 else "trim_squash.npz")
    if not cache.is_file():
        raise FileNotFoundError(f"{cache}: run bench/copy_detection.py with trim_squash and --cache first")
    base = dict(np.load(cache))
    changed = [
        i
        for i, item in enumerate(items)
        if rule_box(_rgb(item), args.rule, args.param) != borders.trim_box(_rgb(item))
    ]
    print(f"{args.rule} {args.param} {args.set}: {len(changed)}/{len(items)} change", file=sys.stderr)
    started = time.perf_counter()
    preprocess.trim_borders = lambda image: (
        image if (box := rule_box(image, args.rule, args.param)) is None else image.crop(box)
    )
    feats = {k: v.copy() for k, v in base.items()}
    if changed:
        bb = load_backbone("embedded")
        new = cd.extract(bb, [items[i] for i in changed], "trim_squash", (224, 224), 16)
        for key in feats:
            feats[key][changed] = new[key]  # [changed, F]
    result: dict[str, Any] = {"rule": args.rule, "param": args.param, "set": args.set}
    result |= {"changed": len(changed), "items": len(items), "forward_s": time.perf_counter() - started}
    for key in ("mean@8", "cls_mean@8"):
        if args.set == "fashion":
            before, after = (cd.fashion_scores(x[key], fashion.labels, 1000) for x in (base, feats))
        else:
            before, after = (_flat(cd.score(x[key], data)) for x in (base, feats))
        result[key] = {"before": before, "after": after}
    return result


def _flat(s: dict[str, Any]) -> dict[str, float]:
    return {"r1": s["r1"], "map": s["map"], **{t: v["r1"] for t, v in s["by_transform"].items()}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rule", required=True, choices=("tiny", "margin", "wide", "framed"))
    parser.add_argument("--param", required=True, type=float)
    parser.add_argument("--set", required=True, choices=("v1", "v2", "fashion"))
    parser.add_argument("--cache", required=True, type=Path, help="copy_detection.py's --cache folder")
    parser.add_argument("--photos-root", type=Path, default=Path("/"))
    parser.add_argument("--threads", type=int, default=2)
    result = probe(parser.parse_args(argv))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
