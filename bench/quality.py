"""Retrieval quality of the embedded backbone, to choose what ``embed(images)`` does with no options.

Two tasks, one run, every block of the model from a single forward per image:

1. Fashion-MNIST class retrieval (Debian ``fashion-mnist`` files): 1,000 gallery / 500 query test images,
   28x28 grey → RGB, upsampled by the resize policy; relevant = same class.
2. Copy detection on real photos: non-overlapping tiles of the photos bundled with scikit-image and
   scikit-learn are the gallery; each tile's transformed copies (crop, flip, brightness, down/up-scale,
   heavy JPEG) are the queries; relevant = the tile it was made from.

For each pooling (cls, mean, cls_mean, gem) x block (0..11, plus the last-4 concatenation and DINOv2's
``linear_eval``) x resize policy, features go through the library's own ``prepare`` → ``features`` →
``pool`` path (final norm included) and are ranked by cosine similarity. Baselines: a random-init DINOv2
of the same architecture (at the recommended policy, or all with ``--baseline-policies all``) and raw
pixels. Writes ``bench/results/quality.md`` and ``quality.json`` (``--quick``: a temp folder).

    HF_HUB_OFFLINE=1 python bench/quality.py [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

from vit_backbone import Backbone, load_backbone
from vit_backbone.catalog.eval_retrieval import read_idx
from vit_backbone.features import Features
from vit_backbone.preprocess import Prepared, ResizePolicy, stack
from vit_backbone.preprocess_config import NATIVE
from vit_backbone.retrieval import (
    RetrievalScores,
    cosine_scores,
    per_query_metrics,
    relevance_ranking,
    summarize,
)

ROOT = Path(__file__).resolve().parents[1]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"
)  # fmt: skip
POOLINGS: tuple[str, ...] = ("cls", "mean", "cls_mean", "gem")
COPY_POLICIES: tuple[ResizePolicy, ...] = ("crop", "squash", "pad", "dynamic")
# Fashion-MNIST images are square: pad and dynamic (at the 224 budget) give exactly squash's pixels
# (checked at run time), so only crop and squash are run and the other two reuse squash's numbers.
FASHION_POLICIES: tuple[ResizePolicy, ...] = ("crop", "squash")
SQUARE_ALIASES: dict[ResizePolicy, ResizePolicy] = {"pad": "squash", "dynamic": "squash"}
# dynamic gets the same token budget as the others (16x16 = 256 patches); with size=None it would use the
# checkpoint's native 37x37 grid (518 px), ~6x the compute, which is not a like-for-like comparison.
DYNAMIC_SIZE = (224, 224)
# EmbedDefaults has no size, so only these policies can be a default exactly as measured here.
DEFAULT_POLICIES: tuple[ResizePolicy, ...] = ("crop", "squash", "pad")
TOP_K = 10
TRANSFORMS: tuple[str, ...] = ("crop", "hflip", "bright", "down4", "jpeg")
# (height, width) before the per-photo scale; a row takes one height, its tiles cycle through the widths.
TILE_SHAPES: tuple[tuple[int, int], ...] = ((240, 320), (320, 240), (300, 300), (200, 400), (240, 180))
TILE_GAP = 8  # px between tiles, so no two gallery items share a pixel
MIN_TILE_STD = 15.0  # skip near-flat tiles (black retina corners, empty sky): they would be duplicates

Key = tuple[str, tuple[int, ...]]  # (pooling, 0-based blocks)


# ---------------------------------------------------------------------------------------------- data


@dataclass
class FashionSet:
    images: np.ndarray  # [G + Q, 28, 28] uint8: gallery rows first, then queries
    labels: np.ndarray  # [G + Q]
    gallery: int
    test_indices: np.ndarray  # [G + Q] indices into the 10k test set

    def pil(self) -> list[Image.Image]:
        return [Image.fromarray(a).convert("RGB") for a in self.images]  # 2-D uint8 → "L" → RGB


def load_fashion(gallery: int, queries: int, seed: int) -> FashionSet:
    images = read_idx(FASHION_DIR / "t10k-images-idx3-ubyte.gz")  # [10000, 28, 28]
    labels = read_idx(FASHION_DIR / "t10k-labels-idx1-ubyte.gz")  # [10000]
    if images.shape[0] != labels.shape[0]:
        raise ValueError("Fashion-MNIST images and labels disagree in count")
    chosen = np.random.default_rng(seed).permutation(len(labels))[: gallery + queries]  # disjoint split
    return FashionSet(images[chosen], labels[chosen].astype(np.int64), gallery, chosen)


def load_photos() -> dict[str, np.ndarray]:
    """Colour photographs shipped inside scikit-image and scikit-learn (no download)."""
    import skimage.data as skd
    from sklearn.datasets import load_sample_images

    photos: dict[str, np.ndarray] = {}
    # colorwheel/logo are synthetic and cat is chelsea again: skipped
    for name in (
        "astronaut",
        "coffee",
        "chelsea",
        "rocket",
        "hubble_deep_field",
        "retina",
        "immunohistochemistry",
    ):
        photos[name] = np.asarray(getattr(skd, name)())
    photos["motorcycle_left"] = np.asarray(skd.stereo_motorcycle()[0])
    sample = load_sample_images()
    for filename, array in zip(sample.filenames, sample.images, strict=True):
        photos[Path(filename).stem] = np.asarray(array)  # china, flower
    return {name: a[..., :3] for name, a in photos.items()}


@dataclass(frozen=True)
class Tile:
    photo: str
    box: tuple[int, int, int, int]  # top, left, height, width
    image: Image.Image


def cut_tiles(photo: str, array: np.ndarray, scale: float) -> list[Tile]:
    """Non-overlapping tiles, row by row; row r uses TILE_SHAPES[r]'s height, its tiles cycle the widths."""
    height, width = array.shape[:2]
    tiles: list[Tile] = []
    top, row = 0, 0
    while True:
        tile_h = round(TILE_SHAPES[row % len(TILE_SHAPES)][0] * scale)
        if top + tile_h > height:
            break
        left, col = 0, row
        while True:
            tile_w = round(TILE_SHAPES[col % len(TILE_SHAPES)][1] * scale)
            if left + tile_w > width:
                break
            crop = array[top : top + tile_h, left : left + tile_w]
            if float(crop.std()) >= MIN_TILE_STD:
                tiles.append(
                    Tile(photo, (top, left, tile_h, tile_w), Image.fromarray(np.ascontiguousarray(crop)))
                )
            left, col = left + tile_w + TILE_GAP, col + 1
        top, row = top + tile_h + TILE_GAP, row + 1
    return tiles


def photo_scale(array: np.ndarray, per_photo: int) -> float:
    """Tile-shape scale so that a photo yields about ``per_photo`` tiles (small photos get small tiles)."""
    mean_area = float(np.mean([h * w for h, w in TILE_SHAPES]))
    packing = 1.4  # row packing and gaps waste ~30% of the area
    return float(
        np.clip(math.sqrt(array.shape[0] * array.shape[1] / (per_photo * packing * mean_area)), 0.35, 2.0)
    )


def make_gallery(per_photo: int, max_tiles: int, seed: int) -> list[Tile]:
    """Tiles of every photo, about ``per_photo`` each; above ``max_tiles`` a seeded subset."""
    tiles = [t for name, a in load_photos().items() for t in cut_tiles(name, a, photo_scale(a, per_photo))]
    if len(tiles) <= max_tiles:
        return tiles
    keep = np.sort(np.random.default_rng(seed).permutation(len(tiles))[:max_tiles])
    return [tiles[i] for i in keep]


def jpeg_bytes(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def random_crop(image: Image.Image, rng: np.random.Generator, area: tuple[float, float]) -> Image.Image:
    """A crop keeping ``area`` of the pixels (uniform), aspect jittered by up to 10%, placed at random."""
    fraction = rng.uniform(*area)
    aspect = math.exp(rng.uniform(math.log(0.9), math.log(1.1)))
    w = min(image.width, round(image.width * math.sqrt(fraction * aspect)))
    h = min(image.height, round(image.height * math.sqrt(fraction / aspect)))
    left = int(rng.integers(0, image.width - w + 1))
    top = int(rng.integers(0, image.height - h + 1))
    return image.crop((left, top, left + w, top + h))


def transform(image: Image.Image, name: str, rng: np.random.Generator) -> Image.Image | bytes:
    if name == "crop":
        return random_crop(image, rng, (0.6, 0.7))
    if name == "hflip":
        return ImageOps.mirror(image)
    if name == "bright":
        return ImageEnhance.Brightness(image).enhance(1.5)
    if name == "down4":
        small = image.resize((max(1, image.width // 4), max(1, image.height // 4)), Image.Resampling.BILINEAR)
        return small.resize(image.size, Image.Resampling.BICUBIC)
    if name == "jpeg":
        return jpeg_bytes(image, int(rng.integers(10, 16)))  # quality 10..15, decoded by the library
    if name == "combo":
        cropped = ImageOps.mirror(random_crop(image, rng, (0.7, 0.8)))
        return jpeg_bytes(ImageEnhance.Brightness(cropped).enhance(1.3), 25)
    raise ValueError(f"unknown transform {name!r}")


@dataclass
class CopySet:
    items: list[Image.Image | bytes]  # gallery tiles first, then queries
    labels: np.ndarray  # [G + Q]: gallery index of the source tile
    transforms: np.ndarray  # [G + Q] str: "" for gallery rows
    gallery: int
    tiles: list[Tile]


def make_copy_set(tiles: list[Tile], transforms: Sequence[str], seed: int) -> CopySet:
    rng = np.random.default_rng(seed)
    items: list[Image.Image | bytes] = [t.image for t in tiles]
    labels, names = list(range(len(tiles))), [""] * len(tiles)
    for name in transforms:
        for index, tile in enumerate(tiles):
            items.append(transform(tile.image, name, rng))
            labels.append(index)
            names.append(name)
    return CopySet(items, np.asarray(labels), np.asarray(names), len(tiles), tiles)


def tile_summary(tiles: Sequence[Tile]) -> str:
    sides = [s for t in tiles for s in t.box[2:]]
    aspects = [t.box[3] / t.box[2] for t in tiles]
    shapes = len({t.box[2:] for t in tiles})
    return (
        f"{shapes} distinct sizes, sides {min(sides)}–{max(sides)} px, aspect (W/H) "
        f"{min(aspects):.2f}–{max(aspects):.2f}"
    )


def to_pil(item: Image.Image | bytes) -> Image.Image:
    return item if isinstance(item, Image.Image) else Image.open(io.BytesIO(item)).convert("RGB")


# ---------------------------------------------------------------------------------------------- features


@dataclass
class Throughput:
    images: int = 0
    forward_s: float = 0.0
    prepare_s: float = 0.0
    passes: list[dict[str, Any]] = field(default_factory=list)


def feature_keys(depth: int) -> list[Key]:
    last4 = tuple(range(depth - 4, depth))
    singles = [(p, (layer,)) for p in POOLINGS for layer in range(depth)]
    return [*singles, *((p, last4) for p in POOLINGS), ("linear_eval", last4)]


def pool_everything(bb: Backbone, feats: Features, keys: Sequence[Key]) -> dict[Key, np.ndarray]:
    return {key: bb.pool(feats, key[0], list(key[1])).float().cpu().numpy() for key in keys}  # type: ignore[arg-type]


def embed_all(
    bb: Backbone,
    items: Sequence[Image.Image | bytes],
    policy: ResizePolicy,
    *,
    batch_size: int,
    stats: Throughput,
    label: str,
) -> dict[Key, np.ndarray]:
    """Every pooled feature of every image under ``policy``: one forward per image, grouped by grid."""
    keys = feature_keys(bb.depth)
    size = DYNAMIC_SIZE if policy == "dynamic" else NATIVE  # 224: this bench's box, whatever the preset's
    chunk = len(items) if policy == "dynamic" else 256  # dynamic: group the whole set to fill batches
    out: dict[Key, np.ndarray] = {}
    started, forward_before = time.perf_counter(), stats.forward_s
    for start in range(0, len(items), chunk):
        t0 = time.perf_counter()
        prepared: list[Prepared] = bb.prepare(
            items[start : start + chunk], size=size, policy=policy, draft=False
        )
        stats.prepare_s += time.perf_counter() - t0
        groups: dict[tuple[int, int], list[int]] = {}
        for offset, item in enumerate(prepared):
            groups.setdefault(item.grid, []).append(offset)
        for members in groups.values():
            for b in range(0, len(members), batch_size):
                chosen = members[b : b + batch_size]
                pixel_values, _ = stack([prepared[i] for i in chosen])  # [b, 3, H, W]
                t0 = time.perf_counter()
                feats = bb.features(pixel_values, layers=list(range(bb.depth)))
                pooled = pool_everything(bb, feats, keys)
                stats.forward_s += time.perf_counter() - t0
                rows = [start + i for i in chosen]
                for key, array in pooled.items():
                    if key not in out:
                        out[key] = np.zeros((len(items), array.shape[1]), dtype=np.float32)
                    out[key][rows] = array
    stats.images += len(items)
    elapsed = time.perf_counter() - started
    forward = stats.forward_s - forward_before
    stats.passes.append({"pass": label, "images": len(items), "wall_s": round(elapsed, 1)})
    print(
        f"  {label}: {len(items)} images in {elapsed:.0f}s ({len(items) / forward:.1f} img/s forward)",
        file=sys.stderr,
    )
    return out


def build_random_init(source: Path, target: Path) -> Path:
    """A ``Dinov2Model`` of the embedded architecture with transformers' own init, seed 0."""
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config.from_pretrained(source)
    torch.manual_seed(0)
    model = Dinov2Model(config)
    model.save_pretrained(target)
    shutil.copy(source / "preprocessor_config.json", target / "preprocessor_config.json")
    return target


# ---------------------------------------------------------------------------------------------- evaluation


def key_name(key: Key) -> str:
    return f"{key[0]}@{'+'.join(str(i) for i in key[1])}"


def evaluate_fashion(features: dict[Key, np.ndarray], data: FashionSet) -> dict[str, dict[str, Any]]:
    g = data.gallery
    results: dict[str, dict[str, Any]] = {}
    for key, x in features.items():
        results[key_name(key)] = score(x[g:], x[:g], data.labels[g:], data.labels[:g]).to_dict()
    return results


def score(
    queries: np.ndarray, gallery: np.ndarray, q_labels: np.ndarray, g_labels: np.ndarray
) -> RetrievalScores:
    relevant = relevance_ranking(cosine_scores(queries, gallery), q_labels, g_labels)
    return summarize(per_query_metrics(relevant, TOP_K), TOP_K, len(g_labels))


def evaluate_copy_matrix(x: np.ndarray, data: CopySet) -> dict[str, Any]:
    g = data.gallery
    relevant = relevance_ranking(cosine_scores(x[g:], x[:g]), data.labels[g:], data.labels[:g])
    per_query = per_query_metrics(relevant, TOP_K)
    names = data.transforms[g:]
    overall: dict[str, Any] = dict(summarize(per_query, TOP_K, g).to_dict())
    overall["by_transform"] = {
        t: {
            k: v
            for k, v in summarize(per_query, TOP_K, g, names == t).to_dict().items()
            if k in ("r1", "map")
        }
        for t in dict.fromkeys(names.tolist())
    }
    return overall


def evaluate_copy(features: dict[Key, np.ndarray], data: CopySet) -> dict[str, dict[str, Any]]:
    return {key_name(key): evaluate_copy_matrix(x, data) for key, x in features.items()}


def raw_pixels_fashion(data: FashionSet) -> dict[str, Any]:
    x = data.images.reshape(len(data.images), -1).astype(np.float64)  # [N, 784]
    x -= x[: data.gallery].mean(axis=0)  # centre on the gallery mean
    g = data.gallery
    return score(x[g:], x[:g], data.labels[g:], data.labels[:g]).to_dict()


def raw_pixels_copy(data: CopySet) -> dict[str, Any]:
    thumbs = [
        np.asarray(to_pil(i).resize((32, 32), Image.Resampling.BICUBIC), dtype=np.float64) for i in data.items
    ]
    x = np.stack(thumbs).reshape(len(thumbs), -1)  # [N, 3072]
    x -= x[: data.gallery].mean(axis=0)
    return evaluate_copy_matrix(x, data)


# ---------------------------------------------------------------------------------------------- choice

Table = dict[str, dict[str, dict[str, Any]]]  # policy → key name → scores


def fashion_for(table: Table, policy: str) -> dict[str, dict[str, Any]]:
    return table[policy] if policy in table else table[SQUARE_ALIASES[policy]]  # type: ignore[index]


def rank_candidates(fashion: Table, copy: Table) -> list[dict[str, Any]]:
    """Every (pooling, blocks, policy) measured on both tasks, best first by mean R@1 (then mean mAP)."""
    rows = []
    for policy, by_key in copy.items():
        for name, c in by_key.items():
            f = fashion_for(fashion, policy)[name]
            rows.append(
                {
                    "key": name,
                    "policy": policy,
                    "fashion_r1": f["r1"],
                    "fashion_map": f["map"],
                    "copy_r1": c["r1"],
                    "copy_map": c["map"],
                    "mean_r1": (f["r1"] + c["r1"]) / 2,
                    "mean_map": (f["map"] + c["map"]) / 2,
                }
            )
    return sorted(rows, key=lambda r: (-r["mean_r1"], -r["mean_map"]))


def choose(ranked: list[dict[str, Any]]) -> dict[str, Any]:
    """The best candidate that ``EmbedDefaults`` can express (dynamic@224 would need a default size)."""
    return next(r for r in ranked if r["policy"] in DEFAULT_POLICIES)


def parse_key(name: str) -> tuple[str, list[int]]:
    pooling, blocks = name.split("@")
    return pooling, [int(b) for b in blocks.split("+")]


def best_single_block(by_key: dict[str, dict[str, Any]], pooling: str) -> str:
    names = [n for n in by_key if n.startswith(pooling + "@") and "+" not in n]
    return max(names, key=lambda n: (by_key[n]["r1"], by_key[n]["map"]))


# ---------------------------------------------------------------------------------------------- report


def cell(s: dict[str, Any] | None, block: str | None = None) -> str:
    if s is None:
        return "—"
    text = f"{s['r1']:.3f} / {s['map']:.3f}"
    return f"{text} (b{block})" if block is not None else text


def task_table(emb: Table, policies: Sequence[str], depth: int, fashion_aliases: bool) -> list[str]:
    last, last4 = str(depth - 1), "+".join(str(i) for i in range(depth - 4, depth))
    head = "| pooling · block | " + " | ".join(policies) + " |"
    lines = [head, "|" + "---|" * (len(policies) + 1)]

    def get(policy: str) -> dict[str, dict[str, Any]]:
        return fashion_for(emb, policy) if fashion_aliases else emb[policy]

    for pooling in POOLINGS:
        lines.append(
            f"| {pooling} · last (b{last}) | "
            + " | ".join(cell(get(p)[f"{pooling}@{last}"]) for p in policies)
            + " |"
        )
        best = {p: best_single_block(get(p), pooling) for p in policies}
        lines.append(
            f"| {pooling} · best block | "
            + " | ".join(cell(get(p)[best[p]], parse_key(best[p])[1][0].__str__()) for p in policies)
            + " |"
        )
        lines.append(
            f"| {pooling} · last 4 concat | "
            + " | ".join(cell(get(p)[f"{pooling}@{last4}"]) for p in policies)
            + " |"
        )
    lines.append(
        f"| linear_eval (b{depth - 4}–{last}) | "
        + " | ".join(cell(get(p)[f"linear_eval@{last4}"]) for p in policies)
        + " |"
    )
    return lines


def baseline_rows(
    name: str, table: Table, pooling: str, policies: Sequence[str], depth: int, aliases: bool
) -> list[str]:
    def get(policy: str) -> dict[str, dict[str, Any]] | None:
        if policy in table:
            return table[policy]
        if aliases and SQUARE_ALIASES.get(policy) in table:  # type: ignore[call-overload]
            return table[SQUARE_ALIASES[policy]]  # type: ignore[index]
        return None

    last = f"{pooling}@{depth - 1}"
    row_last = [cell(t[last]) if (t := get(p)) else "—" for p in policies]
    row_best = []
    for p in policies:
        t = get(p)
        if t is None:
            row_best.append("—")
        else:
            b = best_single_block(t, pooling)
            row_best.append(cell(t[b], str(parse_key(b)[1][0])))
    return [
        f"| {name} {pooling} · last (b{depth - 1}) | " + " | ".join(row_last) + " |",
        f"| {name} {pooling} · best block | " + " | ".join(row_best) + " |",
    ]


def describe(row: dict[str, Any]) -> str:
    pooling, blocks = parse_key(row["key"])
    return f"pooling={pooling!r}, layers={blocks}, policy={row['policy']!r}"


def write_markdown(path: Path, report: dict[str, Any]) -> str:
    meta, rec = report["meta"], report["recommendation"]
    depth = meta["depth"]
    f_emb, c_emb = report["fashion_mnist"]["embedded"], report["copy_detection"]["embedded"]
    f_rnd, c_rnd = report["fashion_mnist"]["random_init"], report["copy_detection"]["random_init"]
    best = rec["best"]
    pooling, blocks = parse_key(best["key"])
    policy = best["policy"]
    fp = policy if policy in f_emb else SQUARE_ALIASES[policy]
    lines = [
        "# Retrieval quality of the embedded backbone",
        "",
        f"Model: `{meta['model']}` ({meta['revision']}), DINOv2 ViT-S/14 fine-tuned for saliency, "
        f"{depth} blocks, D={meta['dim']}. fp32, {meta['threads']} threads, batch {meta['batch_size']}. "
        f"Generated by `python bench/quality.py{' --quick' if meta['quick'] else ''}`; full per-block "
        "numbers in `quality.json`.",
        "",
        "Cells are **R@1 / mAP** (cosine on L2-normalised features). R@1: the nearest gallery item is "
        "relevant (Fashion-MNIST: same class, i.e. top-1 label accuracy; copy detection: the query's source "
        "tile). mAP: average precision over the whole gallery ranking (copy detection has one relevant item, "
        "so it is the mean reciprocal rank). Blocks are 0-based (b11 = last = layers=[-1]); 'best block' is "
        "the best single block by R@1 for that pooling and policy (named in brackets). Every feature passes "
        "the final norm, as `Backbone.pool` does. `dynamic` runs at the same 256-patch budget as the others "
        "(size=(224, 224)). `quality.json` also holds hit@10 (a relevant item among the top 10) and P@10 "
        "(the fraction of the top 10 that is relevant) for every row.",
        "",
        f"## 1. Fashion-MNIST retrieval ({meta['fashion']['gallery']} gallery / {meta['fashion']['queries']} "
        "queries, test split, seed 0)",
        "",
        "28x28 grey → RGB, upsampled by the policy. Images are square, so `pad` and `dynamic` give exactly "
        "`squash`'s pixels (checked at run time) and share its column.",
        "",
        *task_table(f_emb, FASHION_POLICIES, depth, True),
        *[
            r
            for p in dict.fromkeys([pooling, "cls"])
            for r in baseline_rows("random-init", f_rnd, p, FASHION_POLICIES, depth, True)
        ],
        "| raw pixels (28x28, centred; no policy) | "
        + " | ".join([cell(report["fashion_mnist"]["raw_pixels"])] * len(FASHION_POLICIES))
        + " |",
        "",
        f"## 2. Copy detection on real photos ({meta['copy']['gallery']} gallery tiles from "
        f"{len(meta['copy']['photos'])} photos, {meta['copy']['queries']} queries)",
        "",
        f"Photos: {', '.join(meta['copy']['photos'])}. Tiles: non-overlapping, "
        f"{meta['copy']['tile_sizes']}. Queries per tile: {', '.join(meta['copy']['transforms'])} "
        "(crop keeps 60–70% of the area; bright = x1.5; down4 = 1/4 then back up; jpeg = quality 10–15, "
        "fed as bytes and decoded by the library).",
        "",
        *task_table(c_emb, COPY_POLICIES, depth, False),
        *[
            r
            for p in dict.fromkeys([pooling, "cls"])
            for r in baseline_rows("random-init", c_rnd, p, COPY_POLICIES, depth, False)
        ],
        "| raw pixels (32x32 squash, centred) | "
        + " | ".join([cell(report["copy_detection"]["raw_pixels"])] * len(COPY_POLICIES))
        + " |",
        "",
        "R@1 per transform:",
        "",
    ]
    transforms = list(report["copy_detection"]["raw_pixels"]["by_transform"])
    lines += ["| feature | " + " | ".join(transforms) + " | all |", "|" + "---|" * (len(transforms) + 2)]
    rows = [("recommended: " + describe(best), c_emb[policy][best["key"]])]
    default = rec["current_default"]
    rows.append(("current default: " + describe(default), c_emb[default["policy"]][default["key"]]))
    if policy in c_rnd:
        b = best_single_block(c_rnd[policy], pooling)
        rows.append((f"random-init {pooling} b{parse_key(b)[1][0]} {policy}", c_rnd[policy][b]))
    rows.append(("raw pixels", report["copy_detection"]["raw_pixels"]))
    for label, s in rows:
        lines.append(
            f"| {label} | "
            + " | ".join(f"{s['by_transform'][t]['r1']:.3f}" for t in transforms)
            + f" | {s['r1']:.3f} |"
        )
    lines += [
        "",
        f"## R@1 per block ({pooling}, policy {policy})",
        "",
        "| model / task | " + " | ".join(f"b{i}" for i in range(depth)) + " |",
        "|" + "---|" * (depth + 1),
    ]
    for label, table, pol in (
        ("embedded · Fashion-MNIST", f_emb, fp),
        ("random-init · Fashion-MNIST", f_rnd, fp),
        ("embedded · copy detection", c_emb, policy),
        ("random-init · copy detection", c_rnd, policy),
    ):
        if pol in table:
            lines.append(
                f"| {label} | "
                + " | ".join(f"{table[pol][f'{pooling}@{i}']['r1']:.3f}" for i in range(depth))
                + " |"
            )
    lines += [
        "",
        "## Recommendation",
        "",
        f"**`embed(images)` default: {describe(best)}** (layers={[b - depth for b in blocks]} from the end). "
        f"Mean R@1 over the two tasks {best['mean_r1']:.3f} (Fashion-MNIST {best['fashion_r1']:.3f}, "
        f"copy detection {best['copy_r1']:.3f}); mean mAP {best['mean_map']:.3f}.",
        "",
        *[f"- {line}" for line in rec["notes"]],
        "",
        "What the alternatives lose (mean R@1 of the two tasks; Fashion-MNIST / copy R@1 in brackets):",
        "",
        "| alternative | mean R@1 | Δ vs recommended | Fashion R@1 | copy R@1 |",
        "|---|---|---|---|---|",
    ]
    for alt in rec["alternatives"]:
        lines.append(
            f"| {alt['label']}: {describe(alt)} | {alt['mean_r1']:.3f} | "
            f"{alt['mean_r1'] - best['mean_r1']:+.3f} | {alt['fashion_r1']:.3f} | {alt['copy_r1']:.3f} |"
        )
    lines += [
        "",
        "Baselines at the recommended policy (R@1, Fashion-MNIST / copy): "
        + "; ".join(f"{k} {v['fashion_r1']:.3f} / {v['copy_r1']:.3f}" for k, v in rec["baselines"].items())
        + ".",
        "",
        f"Sampling noise: with {meta['fashion']['queries']} and {meta['copy']['queries']} queries a single "
        f"R@1 has a binomial standard error of about {rec['stderr_r1']:.3f}, so differences under "
        f"~{200 * rec['stderr_r1']:.0f} points (2 SE) between rows are not meaningful on their own.",
        "",
        f"## Run\n\nWall time {meta['wall_s']:.0f} s for {meta['images_embedded']} forward images "
        f"({meta['images_per_s_overall']:.1f} images/s overall, "
        f"{meta['images_per_s_forward']:.1f} images/s in forward+pool, prepare {meta['prepare_s']:.0f} s). "
        f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['cpu']}"
        + (
            f", 1-min load average {meta['load_avg_1min_end']:.1f} at the end"
            + (
                " (other processes shared the cores: slower than on an idle machine)."
                if meta["load_avg_1min_end"] > meta["threads"] + 0.5
                else "."
            )
            if "load_avg_1min_end" in meta
            else "."
        ),
        "",
    ]
    text = "\n".join(lines)
    path.write_text(text)
    return text


# ---------------------------------------------------------------------------------------------- main


def check_square_aliases(bb: Backbone, images: Sequence[Image.Image]) -> None:
    """pad and dynamic (at the 224 budget) must give squash's exact pixels on square inputs."""
    squash = bb.prepare(list(images), policy="squash", size=NATIVE, draft=False)
    for policy, size in (("pad", NATIVE), ("dynamic", DYNAMIC_SIZE)):
        other = bb.prepare(list(images), policy=policy, size=size, draft=False)  # type: ignore[arg-type]
        for a, b in zip(squash, other, strict=True):
            if not torch.equal(a.pixel_values, b.pixel_values):
                raise AssertionError(f"policy {policy} differs from squash on a square image")


def check_embed_default(bb: Backbone, images: Sequence[Image.Image], feats: dict[Key, np.ndarray]) -> float:
    """``embed(images)`` with no options must equal the benchmark's own (cls, last block, crop) rows."""
    ours = feats[(bb.defaults.pooling, tuple(bb.resolve_layers(bb.defaults.layers) or [bb.depth - 1]))]
    direct = bb.embed(list(images), draft=False)
    diff = float(np.abs(direct - ours[: len(images)]).max())
    if diff > 1e-4:
        raise AssertionError(f"embed() default differs from the benchmark's features by {diff}")
    return diff


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: few images, results in a temp folder"
    )
    parser.add_argument("--gallery", type=int, help="Fashion-MNIST gallery size (default 1000; quick 200)")
    parser.add_argument("--queries", type=int, help="Fashion-MNIST queries (default 500; quick 100)")
    parser.add_argument("--tiles", type=int, help="max copy-detection gallery tiles (default 110; quick 16)")
    parser.add_argument("--tiles-per-photo", type=int, default=12, help="target tiles cut from each photo")
    parser.add_argument("--combo", action="store_true", help="add a combined crop+flip+bright+JPEG query")
    parser.add_argument(
        "--baseline-policies",
        choices=("recommended", "all"),
        default="recommended",
        help="policies the random-init baseline runs at (default: the recommended one)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, help="default bench/results (quick: a temp folder)")
    parser.add_argument(
        "--report-only",
        type=Path,
        metavar="JSON",
        help="no model: recompute the recommendation and Markdown from an earlier quality.json",
    )
    args = parser.parse_args(argv)
    if args.report_only is not None:
        earlier: dict[str, Any] = json.loads(args.report_only.read_text())
        return finish(earlier, args.out_dir or args.report_only.parent)

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    n_gallery = args.gallery or (200 if args.quick else 1000)
    n_queries = args.queries or (100 if args.quick else 500)
    n_tiles = args.tiles or (16 if args.quick else 110)
    out_dir: Path = args.out_dir or (
        Path(tempfile.mkdtemp(prefix="quality-")) if args.quick else ROOT / "bench" / "results"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = Throughput()

    bb = load_backbone("embedded")
    fashion = load_fashion(n_gallery, n_queries, args.seed)
    fashion_images = fashion.pil()
    check_square_aliases(bb, fashion_images[:8])
    tiles = make_gallery(args.tiles_per_photo, n_tiles, args.seed)
    transforms = (*TRANSFORMS, "combo") if args.combo else TRANSFORMS
    copy = make_copy_set(tiles, transforms, args.seed)
    print(
        f"Fashion-MNIST {n_gallery}+{n_queries}, copy detection {copy.gallery} tiles + "
        f"{len(copy.items) - copy.gallery} queries",
        file=sys.stderr,
    )

    report: dict[str, Any] = {
        "fashion_mnist": {"embedded": {}, "random_init": {}},
        "copy_detection": {"embedded": {}, "random_init": {}},
    }
    embed_check = 0.0
    for policy in FASHION_POLICIES:
        feats = embed_all(
            bb, fashion_images, policy, batch_size=args.batch_size, stats=stats, label=f"fashion {policy}"
        )
        if policy == bb.defaults.policy:
            embed_check = check_embed_default(bb, fashion_images[:8], feats)
        report["fashion_mnist"]["embedded"][policy] = evaluate_fashion(feats, fashion)
    for policy in COPY_POLICIES:
        feats = embed_all(
            bb, copy.items, policy, batch_size=args.batch_size, stats=stats, label=f"copy {policy}"
        )
        report["copy_detection"]["embedded"][policy] = evaluate_copy(feats, copy)
    report["fashion_mnist"]["raw_pixels"] = raw_pixels_fashion(fashion)
    report["copy_detection"]["raw_pixels"] = raw_pixels_copy(copy)

    ranked = rank_candidates(report["fashion_mnist"]["embedded"], report["copy_detection"]["embedded"])
    rec_policy: ResizePolicy = choose(ranked)["policy"]

    # random-init baseline
    with tempfile.TemporaryDirectory(prefix="random-init-") as tmp:
        rnd = load_backbone(build_random_init(bb.checkpoint.path, Path(tmp)))
        copy_policies = COPY_POLICIES if args.baseline_policies == "all" else (rec_policy,)
        fashion_policies = (
            FASHION_POLICIES
            if args.baseline_policies == "all"
            else (SQUARE_ALIASES.get(rec_policy, rec_policy),)
        )
        for policy in fashion_policies:
            feats = embed_all(
                rnd,
                fashion_images,
                policy,
                batch_size=args.batch_size,
                stats=stats,
                label=f"random-init fashion {policy}",
            )
            report["fashion_mnist"]["random_init"][policy] = evaluate_fashion(feats, fashion)
        for policy in copy_policies:
            feats = embed_all(
                rnd,
                copy.items,
                policy,
                batch_size=args.batch_size,
                stats=stats,
                label=f"random-init copy {policy}",
            )
            report["copy_detection"]["random_init"][policy] = evaluate_copy(feats, copy)

    wall = time.perf_counter() - started
    current_blocks = bb.resolve_layers(bb.defaults.layers) or [bb.depth - 1]
    report["meta"] = {
        "model": bb.checkpoint.name,
        "revision": bb.checkpoint.revision,
        "depth": bb.depth,
        "dim": bb.dim,
        "quick": args.quick,
        "seed": args.seed,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "dynamic_size": list(DYNAMIC_SIZE),
        "current_default": {
            "key": f"{bb.defaults.pooling}@{'+'.join(str(i) for i in current_blocks)}",
            "policy": bb.defaults.policy,
        },
        "top_k": TOP_K,
        "fashion": {
            "gallery": n_gallery,
            "queries": n_queries,
            "test_indices_head": fashion.test_indices[:10].tolist(),
            "gallery_class_counts": np.bincount(fashion.labels[:n_gallery], minlength=10).tolist(),
            "classes": list(FASHION_CLASSES),
        },
        "copy": {
            "gallery": copy.gallery,
            "queries": len(copy.items) - copy.gallery,
            "photos": list(dict.fromkeys(t.photo for t in tiles)),
            "tiles_per_photo": {
                p: sum(t.photo == p for t in tiles) for p in dict.fromkeys(t.photo for t in tiles)
            },
            "tile_sizes": tile_summary(tiles),
            "transforms": list(transforms),
        },
        "embed_default_check_max_abs_diff": embed_check,
        "wall_s": wall,
        "images_embedded": stats.images,
        "forward_s": stats.forward_s,
        "prepare_s": stats.prepare_s,
        "images_per_s_overall": stats.images / wall,
        "images_per_s_forward": stats.images / stats.forward_s,
        "passes": stats.passes,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "cpu": f"{platform.machine()} {os.cpu_count()} CPUs",
        "load_avg_1min_end": os.getloadavg()[0],  # > threads means other processes shared the cores
    }
    return finish(report, out_dir)


def finish(report: dict[str, Any], out_dir: Path) -> int:
    """Recommendation, then quality.json and quality.md in ``out_dir``; prints the Markdown."""
    report["recommendation"] = recommend(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = {k: report[k] for k in ("recommendation", "meta", "fashion_mnist", "copy_detection")}
    (out_dir / "quality.json").write_text(json.dumps(ordered, indent=1) + "\n")
    print(write_markdown(out_dir / "quality.md", report))
    print(f"wrote {out_dir / 'quality.md'} and {out_dir / 'quality.json'}", file=sys.stderr)
    return 0


def recommend(report: dict[str, Any]) -> dict[str, Any]:
    """The default to document, what each alternative loses, and the baselines — from the measured tables."""
    meta = report["meta"]
    depth, current_key, current_policy = (
        meta["depth"],
        meta["current_default"]["key"],
        meta["current_default"]["policy"],
    )
    f_emb, c_emb = report["fashion_mnist"]["embedded"], report["copy_detection"]["embedded"]
    ranked = rank_candidates(f_emb, c_emb)
    best = choose(ranked)
    pooling, blocks = parse_key(best["key"])
    by = {(r["key"], r["policy"]): r for r in ranked}

    def top(predicate: Any) -> dict[str, Any]:
        return next(r for r in ranked if predicate(r))

    alternatives: list[dict[str, Any]] = []

    def add(label: str, row: dict[str, Any] | None) -> None:
        if row is None or (row["key"], row["policy"]) == (best["key"], best["policy"]):
            return
        for alt in alternatives:
            if (alt["key"], alt["policy"]) == (row["key"], row["policy"]):
                alt["label"] += f"; {label}"
                return
        alternatives.append({"label": label, **row})

    current = by[(current_key, current_policy)]
    add("current default", current)
    add("same, last block", by.get((f"{pooling}@{depth - 1}", best["policy"])))
    for policy in COPY_POLICIES:
        if policy != best["policy"]:
            add(f"same feature, policy {policy}", by.get((best["key"], policy)))
    for policy in COPY_POLICIES:
        if policy != best["policy"]:
            note = " (needs size=(224, 224))" if policy not in DEFAULT_POLICIES else ""
            add(f"best with policy {policy}{note}", top(lambda r, p=policy: r["policy"] == p))
    for other in (*POOLINGS, "linear_eval"):
        if other != pooling:
            add(f"best with pooling {other}", top(lambda r, o=other: parse_key(r["key"])[0] == o))
    add("best last-block feature", top(lambda r: r["key"].endswith(f"@{depth - 1}")))
    add("best on Fashion-MNIST alone", max(ranked, key=lambda r: (r["fashion_r1"], r["fashion_map"])))
    add("best on copy detection alone", max(ranked, key=lambda r: (r["copy_r1"], r["copy_map"])))

    policy = best["policy"]
    f_rnd = report["fashion_mnist"]["random_init"]
    c_rnd = report["copy_detection"]["random_init"]
    baselines: dict[str, dict[str, float]] = {}
    fp = SQUARE_ALIASES.get(policy, policy)
    if fp in f_rnd and policy in c_rnd:
        baselines[f"random-init {best['key']}"] = {
            "fashion_r1": f_rnd[fp][best["key"]]["r1"],
            "copy_r1": c_rnd[policy][best["key"]]["r1"],
        }
        bf, bc = best_single_block(f_rnd[fp], pooling), best_single_block(c_rnd[policy], pooling)
        baselines[f"random-init {pooling} best blocks (b{parse_key(bf)[1][0]} / b{parse_key(bc)[1][0]})"] = {
            "fashion_r1": f_rnd[fp][bf]["r1"],
            "copy_r1": c_rnd[policy][bc]["r1"],
        }
    baselines["raw pixels"] = {
        "fashion_r1": report["fashion_mnist"]["raw_pixels"]["r1"],
        "copy_r1": report["copy_detection"]["raw_pixels"]["r1"],
    }
    p_f, p_c = best["fashion_r1"], best["copy_r1"]
    nq_f, nq_c = meta["fashion"]["queries"], meta["copy"]["queries"]
    stderr = max(math.sqrt(p_f * (1 - p_f) / nq_f), math.sqrt(p_c * (1 - p_c) / nq_c))
    near = [r for r in ranked if r is not best and abs(best["mean_r1"] - r["mean_r1"]) < 0.01]
    notes = [
        f"Ranked over {len(ranked)} (pooling, blocks, policy) candidates by the mean of the two tasks' R@1 "
        "(ties by mean mAP).",
        f"Against the current default ({describe(current)}): "
        f"{best['mean_r1'] - current['mean_r1']:+.3f} mean R@1 "
        f"(Fashion-MNIST {best['fashion_r1'] - current['fashion_r1']:+.3f}, copy detection "
        f"{best['copy_r1'] - current['copy_r1']:+.3f}).",
        f"{len(near)} other candidates are within 0.01 mean R@1 of it: "
        + ", ".join(f"{r['key']} {r['policy']}" for r in near[:8])
        + ("…" if len(near) > 8 else "")
        + ".",
    ]
    blocks_chosen = sorted(
        {
            parse_key(best_single_block(table[p], pooling))[1][0]
            for table, policies in ((f_emb, FASHION_POLICIES), (c_emb, COPY_POLICIES))
            for p in policies
        }
    )
    notes.append(
        f"Best single block for pooling={pooling!r} under each policy, on each task: "
        f"{', '.join(f'b{b}' for b in blocks_chosen)}; the last block (b{depth - 1}) loses "
        f"{best['mean_r1'] - by[(f'{pooling}@{depth - 1}', best['policy'])]['mean_r1']:.3f} mean R@1."
    )
    same = {p: by[(best["key"], p)] for p in COPY_POLICIES}
    notes.append(
        f"Policy, same feature ({best['key']}): "
        + ", ".join(
            f"{p} {r['mean_r1']:.3f} (Fashion {r['fashion_r1']:.3f}, copy {r['copy_r1']:.3f})"
            for p, r in same.items()
        )
        + "."
    )
    for task, label, field_name in (
        ("fashion_mnist", "Fashion-MNIST", "fashion_r1"),
        ("copy_detection", "copy detection", "copy_r1"),
    ):
        top_task = max(ranked, key=lambda r: (r[field_name], r[field_name.replace("r1", "map")]))
        raw = report[task]["raw_pixels"]["r1"]
        rnd = [v["r1"] for table in report[task]["random_init"].values() for v in table.values()]
        text = (
            f"{label}: best embedded feature R@1 {top_task[field_name]:.3f} ({top_task['key']} "
            f"{top_task['policy']}), recommended {best[field_name]:.3f}, raw pixels {raw:.3f}"
        )
        if rnd:
            text += f", random-init at most {max(rnd):.3f} (any pooling/block)"
        if raw > top_task[field_name]:
            text += ". **Raw pixels beat every embedded feature on this task**"
        notes.append(text + ".")
    if ranked[0] is not best:
        top_row = ranked[0]
        notes.append(
            f"The overall top row is {describe(top_row)} at size=(224, 224) (mean R@1 "
            f"{top_row['mean_r1']:.3f}, {top_row['mean_r1'] - best['mean_r1']:+.3f}); it is not recommended "
            "because embed(policy='dynamic') without a size uses this checkpoint's native 37x37 grid "
            "(518 px, ~6x the compute, not measured), and EmbedDefaults has no size field."
        )
    return {
        "best": best,
        "current_default": current,
        "layers_negative": [b - depth for b in blocks],
        "alternatives": alternatives,
        "baselines": baselines,
        "notes": notes,
        "stderr_r1": stderr,
        "top10": ranked[:10],
    }


if __name__ == "__main__":
    raise SystemExit(main())
