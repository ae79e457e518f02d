"""How much do head probabilities move when a server computes features in bfloat16 autocast?

A head is trained on float32 features; ``vitembed serve`` with the default ``--precision auto`` runs a
bf16-capable CPU in bfloat16 autocast. This script trains a linear probe and a kNN head on float32
features of Fashion-MNIST training images (embedded backbone, defaults: ``mean`` of block 8) and compares
their probabilities on test images embedded in float32 and in bfloat16: max and mean absolute difference,
argmax agreement. Writes ``bench/results/heads_precision.md`` and ``.json`` (``--quick``: 60 / 30 images,
into a temporary folder).

    python -m bench.heads_precision [--quick] [--out DIR] [--train 600] [--test 300]
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
from vit_backbone import Backbone, load_backbone
from vit_backbone.heads.knn import fit_knn, knn_proba
from vit_backbone.heads.linear import fit_softmax
from vit_backbone.heads.train import split
from vit_backbone.pooling import Pooling
from vit_backbone.precision import min_cosine
from vit_backbone.preprocess import stack
from vit_backbone.preprocess_config import NATIVE

POOLING: Pooling = "mean"  # the embedded backbone's defaults
LAYERS = [8]


@dataclass
class PrecisionResults:
    quick: bool
    command: str
    backbone: str
    machine: dict[str, Any]
    seconds: float  # embedding the three sets
    feature_cosine_min: float
    linear: dict[str, float]
    knn: dict[str, float]


def features(bb: Backbone, images: np.ndarray, batch_size: int = 8) -> np.ndarray:
    out = []
    for start in range(0, len(images), batch_size):
        pil = [Image.fromarray(a).convert("RGB") for a in images[start : start + batch_size]]
        pixel_values, _ = stack(bb.prepare(pil, size=NATIVE))  # [b, 3, 224, 224] (the default policy)
        out.append(bb.pooled(pixel_values, POOLING, LAYERS).float().numpy())  # [b, 384]
    return np.concatenate(out)


def compare(exact: np.ndarray, low: np.ndarray) -> dict[str, float]:
    difference = np.abs(exact - low)
    return {
        "max_abs": float(difference.max()),
        "mean_abs": float(difference.mean()),
        "argmax_agreement": float((exact.argmax(1) == low.argmax(1)).mean()),
    }


def measure(args: argparse.Namespace) -> PrecisionResults:
    torch.manual_seed(args.seed)
    x_train_img, y_train = sample("train", args.train, args.seed)
    x_test_img, _ = sample("t10k", args.test, args.seed)
    bb = load_backbone("embedded")
    started = time.perf_counter()
    x_train = features(bb, x_train_img)  # [n, 384] float32: how heads are trained
    x_test = features(bb, x_test_img)
    bb.autocast = torch.bfloat16
    x_test_bf16 = features(bb, x_test_img)
    seconds = time.perf_counter() - started
    train, val = split(y_train, 0.2, args.seed)
    linear = fit_softmax(x_train[train], y_train[train], x_train[val], y_train[val], len(CLASSES))
    knn = fit_knn(x_train[train], y_train[train], x_train[val], y_train[val], len(CLASSES))

    def linear_proba(x: np.ndarray) -> np.ndarray:
        return torch.softmax(linear.params.logits(torch.from_numpy(x)), dim=1).numpy()  # [n, C]

    def knn_probabilities(x: np.ndarray) -> np.ndarray:
        queries = torch.nn.functional.normalize(torch.from_numpy(x), dim=1)  # [n, F]
        return knn_proba(queries, knn.bank, knn.labels, len(CLASSES), knn.k).numpy()  # [n, C]

    return PrecisionResults(
        quick=args.quick,
        command=f"python -m bench.heads_precision --train {args.train} --test {args.test}",
        backbone=bb.checkpoint.revision,
        machine=machine_info(),
        seconds=round(seconds, 1),
        feature_cosine_min=min_cosine(x_test, x_test_bf16),
        linear=compare(linear_proba(x_test), linear_proba(x_test_bf16)),
        knn=compare(knn_probabilities(x_test), knn_probabilities(x_test_bf16)),
    )


def render(results: PrecisionResults, train: int, test: int) -> str:
    m = results.machine
    lines = [
        "# Head probabilities: bfloat16 autocast features vs float32",
        "",
        *quick_note(results.quick),
        f"`{results.command}` — heads trained on float32 features ({POOLING}, block 8) of {train} "
        f"Fashion-MNIST training images; {test} test images embedded in float32 and in bfloat16 "
        f"autocast (embedded backbone `{results.backbone}`; {m['cpu']}, torch {m['torch']}). Min feature "
        f"cosine {results.feature_cosine_min:.5f}.",
        "",
        "| head | max abs difference | mean abs difference | argmax agreement |",
        "|---|---|---|---|",
    ]
    for kind, row in (("linear", results.linear), ("knn", results.knn)):
        lines.append(
            f"| {kind} | {row['max_abs']:.1e} | {row['mean_abs']:.1e} | {row['argmax_agreement']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.heads_precision", description=__doc__.splitlines()[0]
    )
    add_output_options(parser)
    parser.add_argument("--train", type=int, default=None, help="training images (default 600; --quick 60)")
    parser.add_argument("--test", type=int, default=None, help="test images (default 300; --quick 30)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.train = args.train or (60 if args.quick else 600)
    args.test = args.test or (30 if args.quick else 300)
    out = output_dir(args, "heads_precision")
    with bench_lock("heads_precision", enabled=not args.quick):
        results = measure(args)
    write_report(out, "heads_precision", results, render(results, args.train, args.test))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
