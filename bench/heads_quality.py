"""Frozen heads on Fashion-MNIST with the embedded backbone: linear probe and kNN against raw pixels.

Split (Debian ``dataset-fashion-mnist`` IDX files): ``--train`` images drawn from the 60k training set
(stratified by nothing but a seeded permutation; 20 % of them held out to choose the weight decay / k, as
``vitembed heads train`` does) and ``--test`` images from the 10k test set, scored once. Images are 28x28
grey, converted to RGB and embedded with the backbone's defaults (policy ``pad`` → 224 px), float32.

Feature sets, all from ONE forward pass per batch (``Backbone.pooled_many``): the default embedding (mean
patch token of block 8), ``cls_mean`` of block 8, and DINOv2's linear-evaluation input (CLS of blocks 8–11 +
mean patch of block 11). Heads: ``fit_softmax`` (the linear probe behind ``--kind linear``) and ``fit_knn``
(``--kind knn``: cosine, k chosen from 10/20/50/100/200, T = 0.07). Baseline: the same logistic regression
and kNN on the raw 784 pixels. Writes ``bench/results/heads.json`` and ``heads.md`` (``--quick``: 60 /
40 images, into a temporary folder); holds ``/tmp/vitembed_bench.lock`` while it runs (waiting for another
benchmark's lock first).

    python -m bench.heads_quality [--quick] [--out DIR]   # 5,000 train / 2,000 test, ≈ 15 min on 2 cores
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common.fashion import CLASSES, sample
from bench.common.machine import bench_lock, machine_info
from bench.common.report import add_output_options, output_dir, quick_note, write_report
from vit_backbone import load_backbone
from vit_backbone.heads.knn import fit_knn, knn_proba
from vit_backbone.heads.linear import fit_softmax
from vit_backbone.heads.train import split
from vit_backbone.preprocess import stack
from vit_backbone.preprocess_config import NATIVE

FEATURES: dict[str, tuple[Any, list[int]]] = {
    "mean, block 8 (default)": ("mean", [8]),
    "cls_mean, block 8": ("cls_mean", [8]),
    "linear_eval, blocks 8-11": ("linear_eval", [8, 9, 10, 11]),
}


def embed(images: np.ndarray, batch_size: int) -> tuple[dict[str, np.ndarray], float, str]:
    bb = load_backbone("embedded")
    out: dict[str, list[np.ndarray]] = {name: [] for name in FEATURES}
    requests = list(FEATURES.values())
    started = time.perf_counter()
    for start in range(0, len(images), batch_size):
        pil = [Image.fromarray(a).convert("RGB") for a in images[start : start + batch_size]]
        pixel_values, _ = stack(bb.prepare(pil, size=NATIVE))  # 224x224, the default policy
        for name, tensor in zip(FEATURES, bb.pooled_many(pixel_values, requests), strict=True):
            out[name].append(tensor.float().numpy())
        if start // batch_size % 50 == 0:
            done = start + len(pil)
            print(
                f"  embedded {done}/{len(images)} ({done / (time.perf_counter() - started):.1f} images/s)",
                flush=True,
            )
    seconds = time.perf_counter() - started
    return {name: np.concatenate(parts) for name, parts in out.items()}, seconds, bb.checkpoint.revision


def evaluate(
    x_all: np.ndarray, y_all: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, seed: int
) -> dict[str, Any]:
    train, val = split(y_all, 0.2, seed)
    result: dict[str, Any] = {}
    started = time.perf_counter()
    linear = fit_softmax(x_all[train], y_all[train], x_all[val], y_all[val], len(CLASSES))
    logits = linear.params.logits(torch.from_numpy(x_test.astype(np.float32)))
    result["linear"] = {
        "test_accuracy": float((logits.argmax(1).numpy() == y_test).mean()),
        "val_accuracy": linear.val_accuracy,
        "weight_decay": linear.weight_decay,
        "seconds": round(time.perf_counter() - started, 1),
    }
    started = time.perf_counter()
    knn = fit_knn(x_all[train], y_all[train], x_all[val], y_all[val], len(CLASSES))
    queries = torch.nn.functional.normalize(torch.from_numpy(x_test.astype(np.float32)), dim=1)
    predicted = knn_proba(queries, knn.bank, knn.labels, len(CLASSES), knn.k).argmax(1).numpy()
    result["knn"] = {
        "test_accuracy": float((predicted == y_test).mean()),
        "val_accuracy": knn.val_accuracy,
        "k": knn.k,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return result


@dataclass
class HeadsResults:
    """Test accuracy per feature set and head; ``setup`` says what was embedded and how."""

    quick: bool
    machine: dict[str, Any]
    setup: dict[str, Any]
    rows: dict[str, dict[str, Any]]


def measure(args: argparse.Namespace) -> HeadsResults:
    train_images, train_labels = sample("train", args.train, args.seed)
    test_images, test_labels = sample("t10k", args.test, args.seed)
    print(f"embedding {args.train} + {args.test} images", flush=True)
    all_images = np.concatenate([train_images, test_images])  # [train + test, 28, 28]
    features, seconds, revision = embed(all_images, args.batch_size)
    rows: dict[str, dict[str, Any]] = {}
    for name, x in features.items():
        print(f"fitting heads on {name} ({x.shape[1]} dims)", flush=True)
        rows[name] = {
            "dim": int(x.shape[1]),
            **evaluate(x[: args.train], train_labels, x[args.train :], test_labels, args.seed),
        }
    pixels = all_images.reshape(len(all_images), -1).astype(np.float32) / 255  # [train + test, 784]
    print("fitting heads on raw pixels", flush=True)
    rows["raw pixels (28x28 = 784)"] = {
        "dim": 784,
        **evaluate(pixels[: args.train], train_labels, pixels[args.train :], test_labels, args.seed),
    }
    held_out = len(split(train_labels, 0.2, args.seed)[1])
    setup = {
        "train": args.train,
        "test": args.test,
        "fit": args.train - held_out,
        "held_out": held_out,
        "seed": args.seed,
        "revision": revision,
        "embed_seconds": seconds,
        "images_per_s": (args.train + args.test) / seconds,
    }
    return HeadsResults(args.quick, machine_info(), setup, rows)


def render(results: HeadsResults) -> str:
    setup, m = results.setup, results.machine
    lines = [
        "# Frozen heads on Fashion-MNIST",
        "",
        *quick_note(results.quick),
        f"`python -m bench.heads_quality --train {setup['train']} --test {setup['test']}` — "
        f"{setup['train']} images from the training set ({setup['fit']} fitted, {setup['held_out']} held out "
        f"to choose the weight decay / k), {setup['test']} from the test set; embedded backbone "
        f"(`{setup['revision']}`), defaults (policy `pad`, 224 px), float32; {setup['embed_seconds']:.0f} s "
        f"to embed {setup['train'] + setup['test']} images ({setup['images_per_s']:.1f} images/s, all three "
        f"feature sets from one forward pass); {m['cpu']}, {m['cores']} CPUs, torch {m['torch']}, load "
        f"average at start {m['load_average']}.",
        "",
        "| features | dim | linear probe | kNN (k) |",
        "|---|---|---|---|",
    ]
    for name, row in results.rows.items():
        lines.append(
            f"| {name} | {row['dim']} | {row['linear']['test_accuracy']:.3f} | "
            f"{row['knn']['test_accuracy']:.3f} ({row['knn']['k']}) |"
        )
    lines += [
        "",
        "Test accuracy on the held-out test images; chance is 0.100. Linear probe: standardised features, "
        "softmax regression, L-BFGS, weight decay from "
        "{0.1, 0.03, 0.01, 0.003, 0.001, 3e-4, 1e-4, 1e-5, 0} chosen on the held-out split. "
        "kNN: cosine on L2-normalised features, votes exp(sim / 0.07), k from {10, 20, 50, 100, 200}.",
        "",
        f"With {setup['test']} test images one accuracy has a standard error of about "
        f"{np.sqrt(0.85 * 0.15 / setup['test']):.3f}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.heads_quality", description=__doc__.splitlines()[0]
    )
    add_output_options(parser)
    parser.add_argument("--train", type=int, default=None, help="training images (default 5000; --quick 60)")
    parser.add_argument("--test", type=int, default=None, help="test images (default 2000; --quick 40)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    args.train = args.train or (60 if args.quick else 5_000)
    args.test = args.test or (40 if args.quick else 2_000)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = output_dir(args, "heads")
    with bench_lock("heads_quality", enabled=not args.quick):
        results = measure(args)
    write_report(out, "heads", results, render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
