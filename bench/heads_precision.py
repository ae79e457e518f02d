"""How much do head probabilities move when a server computes features in bfloat16 autocast?

A head is trained on float32 features; ``vitembed serve`` with the default ``--precision auto`` runs a
bf16-capable CPU in bfloat16 autocast. This script trains a linear probe and a kNN head on float32
features of Fashion-MNIST training images (embedded backbone, defaults: ``mean`` of block 8) and compares
their probabilities on test images embedded in float32 and in bfloat16: max and mean absolute difference,
argmax agreement. Writes ``bench/results/heads_precision.md`` and ``.json``.

    python bench/heads_precision.py [--train 600] [--test 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heads_quality import CLASSES, RESULTS, bench_lock, load

from vit_backbone import Backbone, load_backbone
from vit_backbone.heads.knn import fit_knn, knn_proba
from vit_backbone.heads.linear import fit_softmax
from vit_backbone.heads.train import split
from vit_backbone.pooling import Pooling
from vit_backbone.preprocess import stack

POOLING: Pooling = "mean"  # the embedded backbone's defaults
LAYERS = [8]


def features(bb: Backbone, images: np.ndarray, batch_size: int = 8) -> np.ndarray:
    out = []
    for start in range(0, len(images), batch_size):
        pil = [Image.fromarray(a).convert("RGB") for a in images[start : start + batch_size]]
        pixel_values, _ = stack(bb.prepare(pil))  # [b, 3, 224, 224] (policy pad)
        out.append(bb.pooled(pixel_values, POOLING, LAYERS).float().numpy())  # [b, 384]
    return np.concatenate(out)


def compare(exact: np.ndarray, low: np.ndarray) -> dict[str, float]:
    difference = np.abs(exact - low)
    return {
        "max_abs": float(difference.max()),
        "mean_abs": float(difference.mean()),
        "argmax_agreement": float((exact.argmax(1) == low.argmax(1)).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    x_train_img, y_train = load("train", args.train, args.seed)
    x_test_img, _ = load("t10k", args.test, args.seed)
    with bench_lock():
        bb = load_backbone("embedded")
        started = time.perf_counter()
        x_train = features(bb, x_train_img)  # float32: how heads are trained
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

    report: dict[str, Any] = {
        "command": f"python bench/heads_precision.py --train {args.train} --test {args.test}",
        "backbone": bb.checkpoint.revision,
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "seconds": round(seconds, 1),
        "feature_cosine_min": float(
            (
                (x_test * x_test_bf16).sum(1)
                / (np.linalg.norm(x_test, axis=1) * np.linalg.norm(x_test_bf16, axis=1))
            ).min()
        ),
        "linear": compare(linear_proba(x_test), linear_proba(x_test_bf16)),
        "knn": compare(knn_probabilities(x_test), knn_probabilities(x_test_bf16)),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "heads_precision.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Head probabilities: bfloat16 autocast features vs float32",
        "",
        f"`{report['command']}` — heads trained on float32 features ({POOLING}, block 8) of {args.train} "
        f"Fashion-MNIST training images; {args.test} test images embedded in float32 and in bfloat16 "
        f"autocast (embedded backbone `{report['backbone']}`; {report['machine']}). Min feature cosine "
        f"{report['feature_cosine_min']:.5f}.",
        "",
        "| head | max abs difference | mean abs difference | argmax agreement |",
        "|---|---|---|---|",
    ]
    for kind in ("linear", "knn"):
        row = report[kind]
        lines.append(
            f"| {kind} | {row['max_abs']:.1e} | {row['mean_abs']:.1e} | {row['argmax_agreement']:.3f} |"
        )
    (RESULTS / "heads_precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
