"""Probe another border-trim rule for ``trim_squash`` without re-running the whole copy bench.

Only the items whose trim box changes under the rule get a new forward; every other row is taken from the
cached ``trim_squash`` features that ``bench/copy_detection.py`` wrote (``--cache``: ``trim_squash.npz``
for set v1, ``v2-trim_squash.npz`` for v2, ``fashion-1000-2000-trim_squash.npz`` for Fashion-MNIST), so a
probe costs the changed items' forwards. Rules (``--param``):

- ``tiny``: no trim when the image's short side is under PARAM px;
- ``margin``: keep PARAM × the kept size of border on each trimmed side;
- ``wide``: trim a side only when its flat border is at least PARAM of that dimension.

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
        raise ValueError(f"unknown rule {rule!r}: tiny, margin or wide")
    return None if out == (0, 0, w, h) else out


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
    parser.add_argument("--rule", required=True, choices=("tiny", "margin", "wide"))
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
