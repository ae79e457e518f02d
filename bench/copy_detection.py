"""Copy detection on harder copies, to choose the embedded default (issue 13).

The set is frozen in ``bench/copy_set.json`` (seed, sizes, transform parameters): gallery = ``originals``
photo tiles of varied aspect ratios plus ``distractors`` other tiles of the same photos (hard negatives);
each original gets one query per transform: ``crop`` (60–90 % area), ``hflip``, ``bright`` (darker or
brighter), ``aspect`` (each axis downscaled by its own factor), ``jpeg`` (quality 10–30), ``letterbox``
(the image on a border, sometimes with a screenshot-style bar) and ``user`` (crop + maybe flip + brightness
+ per-axis rescale + JPEG 40–80, what a user's copy goes through). Relevant = the tile the query came from.

``--set v2`` (frozen in ``bench/copy_set_v2.json`` before it was first evaluated; a held-out check of the
choice made on v1, never used to choose): whole photographs from two wallpaper packages plus the bundled
photos (``bench/common/wallpapers.py``; ``--photos-root`` where the packages are extracted), each downscaled
to an upload size (long side 640–1024, seeded). ``originals`` of them are queried with the same transforms;
the others are distractors, each whole and as its two non-overlapping halves. Report:
``copy_detection_v2.{md,json}``.

Feature variants (one forward each, every candidate block from it, cached on disk under ``--cache``):
``pad`` (letterbox masked: pooling weights, attention, positions), ``pad_unmasked`` (the same pixels with
every patch treated as image: the old ``pad``, up to its half-patch centring), ``squash``, ``crop``,
``trim_squash``...; ``POLICY@N`` prepares into an N x N box instead of the set's (``trim_squash@98``).
``--mirror`` runs each variant's mirror image too and adds ``POOLING_hflip@BLOCK`` (the mean of the two
L2-normalised features: what the library's ``*_hflip`` poolings compute).

``--presets default-v2,default-v3`` embeds through the product path itself (``Backbone.embed(images,
preset=...)``: its decode, draft JPEG decoding, policy, box and pooling), so the default's row is the
default as users get it, not a reconstruction. The dedup threshold curve and the row at the preset's
calibrated threshold are reported for the presets.
Measuring (``measure``) is separate from writing the report (``write_report``).

    python bench/copy_detection.py [--quick] [--variants pad,trim_squash@98] [--mirror]
        [--presets default-v2,default-v3] [--fashion-variants ...] [--set v2 --photos-root /]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageEnhance, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.wallpapers import halves, load_v2_photos, upload_size
from copy_report import write_report
from quality import cut_tiles, load_photos, photo_scale

from vit_backbone import Backbone, load_backbone
from vit_backbone.catalog.dedup import DEFAULT_THRESHOLD, PRESET_THRESHOLDS
from vit_backbone.preprocess import stack, stack_valid
from vit_backbone.retrieval import cosine_scores, per_query_metrics, relevance_ranking, summarize

CONFIGS = {
    "v1": Path(__file__).resolve().parent / "copy_set.json",
    "v2": Path(__file__).resolve().parent / "copy_set_v2.json",
}
RESULTS = Path(__file__).resolve().parent / "results"
POOLINGS = ("mean", "gem", "cls", "cls_mean")
BLOCKS = (8, 9, 10, 11)  # 0-based; the forward stops at the deepest
TOP_K = 10


@dataclass
class CopySet:
    items: list[Image.Image | bytes]  # gallery first, then queries
    labels: np.ndarray  # [G + Q]
    transforms: np.ndarray  # [G + Q] str; "" for gallery rows
    gallery: int
    originals: list[str] | None = None  # set v2: the photo behind each original, in label order


def _jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _crop(image: Image.Image, rng: np.random.Generator, area: Sequence[float]) -> Image.Image:
    fraction = rng.uniform(area[0], area[1])
    aspect = math.exp(rng.uniform(math.log(0.8), math.log(1.25)))
    w = min(image.width, max(8, round(image.width * math.sqrt(fraction * aspect))))
    h = min(image.height, max(8, round(image.height * math.sqrt(fraction / aspect))))
    left, top = int(rng.integers(0, image.width - w + 1)), int(rng.integers(0, image.height - h + 1))
    return image.crop((left, top, left + w, top + h))


def _axis_scale(
    image: Image.Image, rng: np.random.Generator, scale: Sequence[float], min_ratio: float
) -> Image.Image:
    while True:
        sx, sy = rng.uniform(scale[0], scale[1]), rng.uniform(scale[0], scale[1])
        if max(sx, sy) / min(sx, sy) >= min_ratio:
            break
    size = (max(8, round(image.width * sx)), max(8, round(image.height * sy)))
    return image.resize(size, Image.Resampling.BILINEAR)


def _letterbox(
    image: Image.Image, rng: np.random.Generator, margin: Sequence[float], bar: float
) -> Image.Image:
    left, right, top, bottom = (
        round(s * rng.uniform(margin[0], margin[1]))
        for s in (image.width, image.width, image.height, image.height)
    )
    colour = tuple(
        int(c)
        for c in rng.choice([[0, 0, 0], [255, 255, 255], [128, 128, 128], list(rng.integers(0, 256, 3))])
    )
    canvas = Image.new("RGB", (image.width + left + right, image.height + top + bottom), colour)
    canvas.paste(image, (left, top))
    if rng.uniform() < bar:  # screenshot-style: a title bar of another colour across the top margin
        ImageDraw.Draw(canvas).rectangle((0, 0, canvas.width, max(4, top // 2)), fill=(40, 40, 60))
    return canvas


def transform(
    image: Image.Image, name: str, p: dict[str, Any], rng: np.random.Generator
) -> Image.Image | bytes:
    if name == "crop":
        return _crop(image, rng, p["area"])
    if name == "hflip":
        return ImageOps.mirror(image)
    if name == "bright":
        low, high = p["factors"]
        return ImageEnhance.Brightness(image).enhance(rng.uniform(*(low if rng.uniform() < 0.5 else high)))
    if name == "aspect":
        return _axis_scale(image, rng, p["scale"], p["min_ratio"])
    if name == "jpeg":
        return _jpeg(image, int(rng.integers(p["quality"][0], p["quality"][1] + 1)))
    if name == "letterbox":
        return _letterbox(image, rng, p["margin"], p["bar"])
    if name == "user":
        out = _crop(image, rng, p["area"])
        if rng.uniform() < p["flip"]:
            out = ImageOps.mirror(out)
        out = ImageEnhance.Brightness(out).enhance(rng.uniform(*p["bright"]))
        out = _axis_scale(out, rng, p["scale"], 1.0)
        return _jpeg(out, int(rng.integers(p["quality"][0], p["quality"][1] + 1)))
    raise ValueError(f"unknown transform {name!r}")


def make_set(config: dict[str, Any], quick: bool) -> CopySet:
    rng = np.random.default_rng(config["seed"])
    photos = load_photos()
    tiles = [
        t.image
        for name, a in photos.items()
        for t in cut_tiles(name, a, photo_scale(a, config["tiles_per_photo"]))
    ]
    order = rng.permutation(len(tiles))
    n_orig, n_dist = (24, 16) if quick else (config["originals"], config["distractors"])
    if n_orig + n_dist > len(tiles):
        raise ValueError(f"only {len(tiles)} tiles for {n_orig} originals + {n_dist} distractors")
    originals = [tiles[i] for i in order[:n_orig]]
    distractors = [tiles[i] for i in order[n_orig : n_orig + n_dist]]
    return _with_queries(originals, distractors, config, config["queries_per_original"], rng)


def _with_queries(
    originals: list[Image.Image],
    distractors: list[Image.Image],
    config: dict[str, Any],
    per_original: int,
    rng: np.random.Generator,
) -> CopySet:
    items: list[Image.Image | bytes] = [*originals, *distractors]
    labels = list(range(len(originals))) + [100_000 + k for k in range(len(distractors))]
    names = [""] * len(items)
    for name, params in config["transforms"].items():
        for index, image in enumerate(originals):
            for _ in range(per_original):
                items.append(transform(image, name, params, rng))
                labels.append(index)
                names.append(name)
    return CopySet(items, np.asarray(labels), np.asarray(names), len(originals) + len(distractors))


def make_set_v2(config: dict[str, Any], quick: bool, root: Path) -> CopySet:
    """Whole photos at upload size: ``originals`` queried, the rest distractors (whole + two halves each)."""
    rng = np.random.default_rng(config["seed"])
    photos = load_v2_photos(root, load_photos())
    names = list(photos)
    n_orig, n_dist = config["originals"], config["distractor_photos"]
    if n_orig + n_dist != len(names):
        raise ValueError(f"{len(names)} photos for {n_orig} originals + {n_dist} distractor photos")
    order = rng.permutation(len(names))
    low, high = config["long_side"]

    def upload(image: Image.Image) -> Image.Image:
        return upload_size(image, int(rng.integers(low, high + 1)))

    chosen = [names[i] for i in order[:n_orig]]
    originals = [upload(photos[n]) for n in chosen]
    others = [photos[names[i]] for i in order[n_orig:]]
    distractors = [upload(d) for photo in others for d in (photo, *halves(photo))]
    if quick:
        chosen, originals, distractors = chosen[:6], originals[:6], distractors[:6]
    data = _with_queries(originals, distractors, config, 2 if quick else config["queries_per_original"], rng)
    data.originals = chosen
    return data


def query_widths(data: CopySet) -> dict[str, dict[str, float]]:
    """Per transform: median and 10th-percentile width (px) of the queries as the model receives them."""
    g = data.gallery
    widths = np.asarray(
        [(Image.open(io.BytesIO(i)) if isinstance(i, bytes) else i).width for i in data.items[g:]]
    )
    out = {}
    for t in dict.fromkeys(data.transforms[g:].tolist()):
        w = widths[data.transforms[g:] == t]
        out[t] = {"median": float(np.median(w)), "p10": float(np.percentile(w, 10))}
    return out


def split_variant(variant: str, box: tuple[int, int]) -> tuple[str, tuple[int, int]]:
    """``trim_squash@98`` -> (``trim_squash``, (98, 98)); a bare policy keeps the set's box."""
    policy, _, side = variant.partition("@")
    return policy, (box if not side else (int(side), int(side)))


def extract(
    bb: Backbone,
    items: Sequence[Image.Image | bytes],
    variant: str,
    box: tuple[int, int],
    batch: int,
    *,
    mirror: bool = False,
) -> dict[str, np.ndarray]:
    """Every (pooling, block) feature of every item from one forward per image (stopping at max(BLOCKS)).

    ``variant`` is a resize policy (``pad``, ``squash``, ``crop``, ``dynamic``, ``trim_pad``...), optionally
    ``@N`` for an N x N box, or ``pad_unmasked`` (pad's pixels with every patch treated as image).
    ``dynamic`` items run grouped by grid. ``mirror``: the features of the mirror images.
    """
    variant, box = split_variant(variant, box)
    policy = "pad" if variant == "pad_unmasked" else variant
    rows: dict[str, list[tuple[int, np.ndarray]]] = {}
    started = time.perf_counter()
    for start in range(0, len(items), batch):
        prepared = bb.prepare(items[start : start + batch], policy=policy, size=box, draft=False)  # type: ignore[arg-type]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p.grid, []).append(i)
        for indices in groups.values():
            chosen = [prepared[i] for i in indices]
            pixels, _ = stack(chosen)  # [b, 3, H, W]
            valid = None if variant == "pad_unmasked" else stack_valid(chosen)  # [b, h, w] or None
            if mirror:
                pixels = pixels.flip(-1)  # [b, 3, H, W]
                valid = None if valid is None else valid.flip(-1)  # [b, h, w]
            tokens = bb.layer_features(pixels, list(BLOCKS), valid=valid)
            for block in BLOCKS:
                for pooling in POOLINGS:
                    pooled = _pool(tokens[block], pooling).float().numpy()  # [b, F]
                    rows.setdefault(f"{pooling}@{block}", []).extend(
                        (start + i, row) for i, row in zip(indices, pooled, strict=True)
                    )
        done = start + len(prepared)
        if done % (batch * 25) == 0:
            rate = done / (time.perf_counter() - started)
            print(f"  {variant}: {done}/{len(items)} ({rate:.1f} img/s)", file=sys.stderr, flush=True)
    return {k: np.stack([row for _, row in sorted(v, key=lambda r: r[0])]) for k, v in rows.items()}


def with_mirrored(feats: dict[str, np.ndarray], mirrored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feats`` plus ``POOLING_hflip@BLOCK``: the mean of each image's and its mirror's unit features."""
    out = dict(feats)
    for key, x in feats.items():
        pooling, block = key.split("@")
        out[f"{pooling}_hflip@{block}"] = (_unit(x) + _unit(mirrored[key])) / 2
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def embed_preset(
    bb: Backbone, items: Sequence[Image.Image | bytes], preset: str, batch: int
) -> dict[str, np.ndarray]:
    """The product path: ``Backbone.embed(items, preset=preset)`` with nothing else given."""
    rows = []
    started = time.perf_counter()
    for start in range(0, len(items), batch * 8):
        rows.append(bb.embed(list(items[start : start + batch * 8]), preset=preset, batch_size=batch))
        done = start + len(rows[-1])
        print(
            f"  {preset}: {done}/{len(items)} ({done / (time.perf_counter() - started):.1f} img/s)",
            file=sys.stderr,
            flush=True,
        )
    return {"preset": np.concatenate(rows)}


def _pool(tokens: Any, pooling: str) -> torch.Tensor:
    from vit_backbone.pooling import pool_layer

    return pool_layer(tokens, pooling)  # type: ignore[arg-type]


def score(x: np.ndarray, data: CopySet) -> dict[str, Any]:
    g = data.gallery
    relevant = relevance_ranking(cosine_scores(x[g:], x[:g]), data.labels[g:], data.labels[:g])
    per_query = per_query_metrics(relevant, TOP_K)
    names = data.transforms[g:]
    result: dict[str, Any] = {
        k: v for k, v in summarize(per_query, TOP_K, g).to_dict().items() if k in ("r1", "map")
    }
    result["by_transform"] = {
        t: {
            k: v
            for k, v in summarize(per_query, TOP_K, g, names == t).to_dict().items()
            if k in ("r1", "map")
        }
        for t in dict.fromkeys(names.tolist())
    }
    return result


def pair_curve(x: np.ndarray, data: CopySet, threshold: float = DEFAULT_THRESHOLD) -> list[dict[str, float]]:
    """Query–gallery pairs above a cosine threshold: precision and recall of 'is a copy' per threshold."""
    g = data.gallery
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = xn[g:] @ xn[:g].T  # [Q, G]
    same = data.labels[g:, None] == data.labels[None, :g]  # [Q, G]
    curve = []
    for t in sorted({*np.round(np.arange(0.50, 0.96, 0.025), 3).tolist(), threshold}):
        above = sims >= t
        tp = int((above & same).sum())
        curve.append(
            {
                "threshold": float(t),
                "precision": tp / max(1, int(above.sum())),
                "recall": tp / int(same.sum()),
            }
        )
    return curve


def at_threshold(x: np.ndarray, data: CopySet, threshold: float) -> dict[str, Any]:
    """Query–original pairs at one threshold (the dedup default): precision, recall, recall per transform."""
    g = data.gallery
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = xn[g:] @ xn[:g].T  # [Q, G]
    same = data.labels[g:, None] == data.labels[None, :g]  # [Q, G]
    above = sims >= threshold  # [Q, G]
    hit = (above & same).any(axis=1)  # [Q]: each query has exactly one original
    names = data.transforms[g:]
    return {
        "threshold": threshold,
        "precision": int((above & same).sum()) / max(1, int(above.sum())),
        "recall": float(hit.mean()),
        "recall_by_transform": {t: float(hit[names == t].mean()) for t in dict.fromkeys(names.tolist())},
    }


def _cached(cache: Path, compute: Any, timings: dict[str, float], label: str) -> dict[str, np.ndarray]:
    if cache.is_file():
        return dict(np.load(cache))
    t0 = time.perf_counter()
    feats: dict[str, np.ndarray] = compute()
    timings[label] = round(time.perf_counter() - t0, 1)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **feats)  # type: ignore[arg-type]
    return feats


def fashion_scores(x: np.ndarray, labels: np.ndarray, gallery: int) -> dict[str, float]:
    relevant = relevance_ranking(cosine_scores(x[gallery:], x[:gallery]), labels[gallery:], labels[:gallery])
    s = summarize(per_query_metrics(relevant, TOP_K), TOP_K, gallery).to_dict()
    return {"r1": s["r1"], "map": s["map"]}


def measure(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    bb = load_backbone("embedded")
    v2 = args.set == "v2"
    data = make_set_v2(config, args.quick, args.photos_root) if v2 else make_set(config, args.quick)
    box = tuple(config["box"])
    prefix = ("quick-" if args.quick else "") + ("v2-" if v2 else "")
    print(f"copy set: {data.gallery} gallery, {len(data.items) - data.gallery} queries", file=sys.stderr)
    results: dict[str, Any] = {"config": config, "quick": args.quick, "variants": {}, "gallery": data.gallery}
    results["set"] = args.set
    results["queries_per_transform"] = {t: int((data.transforms == t).sum()) for t in config["transforms"]}
    results["query_width"] = query_widths(data)
    if data.originals is not None:
        results["originals"] = data.originals
    timings: dict[str, float] = results.setdefault("extract_s", {})
    for variant in [v for v in args.variants.split(",") if v]:
        feats = _cached(
            args.cache / f"{prefix}{variant}.npz",
            lambda v=variant: extract(bb, data.items, v, box, args.batch_size),
            timings,
            variant,
        )
        if args.mirror:
            mirrored = _cached(
                args.cache / f"{prefix}{variant}-mirror.npz",
                lambda v=variant: extract(bb, data.items, v, box, args.batch_size, mirror=True),
                timings,
                f"{variant} mirror",
            )
            feats = with_mirrored(feats, mirrored)
        results["variants"][variant] = {key: score(x, data) for key, x in feats.items()}
    for preset in [p for p in args.presets.split(",") if p]:
        feats = _cached(
            args.cache / f"{prefix}preset-{preset}.npz",
            lambda p=preset: embed_preset(bb, data.items, p, args.batch_size),
            timings,
            f"preset {preset}",
        )
        results.setdefault("presets", {})[preset] = score(feats["preset"], data)
        threshold = PRESET_THRESHOLDS.get(preset, DEFAULT_THRESHOLD)
        results.setdefault("curves", {})[preset] = pair_curve(feats["preset"], data, threshold)
        results.setdefault("at_default_threshold", {})[preset] = at_threshold(
            feats["preset"], data, threshold
        )
    if args.fashion_variants or args.presets:
        from quality import load_fashion

        g, q = (40, 60) if args.quick else (args.fashion_gallery, args.fashion_queries)
        fashion = load_fashion(g, q, 0)
        images = fashion.pil()
        results["fashion"] = {"gallery": g, "queries": q, "seed": 0, "variants": {}}
        for variant in [v for v in args.fashion_variants.split(",") if v]:
            feats = _cached(
                args.cache / f"{prefix}fashion-{g}-{q}-{variant}.npz",
                lambda v=variant: extract(bb, images, v, box, args.batch_size),
                timings,
                f"fashion {variant}",
            )
            if args.mirror:
                mirrored = _cached(
                    args.cache / f"{prefix}fashion-{g}-{q}-{variant}-mirror.npz",
                    lambda v=variant: extract(bb, images, v, box, args.batch_size, mirror=True),
                    timings,
                    f"fashion {variant} mirror",
                )
                feats = with_mirrored(feats, mirrored)
            results["fashion"]["variants"][variant] = {
                key: fashion_scores(x, fashion.labels, g) for key, x in feats.items()
            }
        for preset in [p for p in args.presets.split(",") if p]:
            feats = _cached(
                args.cache / f"{prefix}fashion-{g}-{q}-preset-{preset}.npz",
                lambda p=preset: embed_preset(bb, images, p, args.batch_size),
                timings,
                f"fashion preset {preset}",
            )
            results["fashion"].setdefault("presets", {})[preset] = fashion_scores(
                feats["preset"], fashion.labels, g
            )
    results["candidates"] = candidates(results)
    return results


def candidates(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (variant, feature) measured on both sets, best copy R@1 first, with the issue's bar checked:
    copy R@1 >= 0.95, no transform row < 0.85, Fashion-MNIST R@1 >= 0.712 (the old default's)."""
    fashion = results.get("fashion", {}).get("variants", {})
    fashion_presets = results.get("fashion", {}).get("presets", {})
    rows = []
    for variant, by_key in results["variants"].items():
        for key, s in by_key.items():
            f = fashion.get(variant, {}).get(key) or fashion.get(_square_alias(variant), {}).get(key)
            rows.append(_candidate(variant, key, s, f))
    for preset, s in results.get("presets", {}).items():
        rows.append(_candidate(f"preset {preset}", "Backbone.embed", s, fashion_presets.get(preset)))
    return sorted(rows, key=lambda r: (-r["meets"], -r["r1"], -r["map"]))


def _candidate(variant: str, feature: str, s: dict[str, Any], f: dict[str, float] | None) -> dict[str, Any]:
    worst = min(t["r1"] for t in s["by_transform"].values())
    return {
        "variant": variant,
        "feature": feature,
        "r1": s["r1"],
        "map": s["map"],
        "worst_row": worst,
        "fashion_r1": None if f is None else f["r1"],
        "fashion_map": None if f is None else f["map"],
        "meets": bool(s["r1"] >= 0.95 and worst >= 0.85 and f is not None and f["r1"] >= 0.712),
    }


def _square_alias(variant: str) -> str:
    """Fashion-MNIST images are square: pad and squash give them the same pixels."""
    policy, _, side = variant.partition("@")
    alias = {"squash": "pad", "pad": "squash"}.get(policy, policy)
    return alias + (f"@{side}" if side else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a few dozen images: checks the bench runs")
    parser.add_argument("--variants", help="default pad,pad_unmasked,squash (quick: pad)")
    parser.add_argument("--fashion-variants", default="", help="policies to run on Fashion-MNIST too")
    parser.add_argument("--mirror", action="store_true", help="also the mirror images: POOLING_hflip@BLOCK")
    parser.add_argument(
        "--presets",
        default="default-v2,default-v3",
        help="named defaults embedded through Backbone.embed ('': none)",
    )
    parser.add_argument("--fashion-gallery", type=int, default=1000)
    parser.add_argument("--fashion-queries", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "vitembed-copy-cache")
    parser.add_argument("--out", "--out-dir", dest="out_dir", type=Path)
    parser.add_argument("--set", choices=sorted(CONFIGS), default="v1", help="v1: tiles; v2: whole photos")
    parser.add_argument(
        "--photos-root",
        type=Path,
        default=Path("/"),
        help="set v2: where mate-backgrounds and plasma-workspace-wallpapers are installed or dpkg -x'ed",
    )
    args = parser.parse_args(argv)
    args.variants = args.variants if args.variants is not None else ("pad" if args.quick else "pad,squash")
    if args.quick and args.out_dir is not None:
        args.cache = args.out_dir / "cache"  # a smoke run never reads features cached by another run
    config = json.loads(CONFIGS[args.set].read_text())
    results = measure(args, config)
    out = args.out_dir or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    write_report(results, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
