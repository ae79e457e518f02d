"""Catalog benchmark: `vitembed embed-catalog` images/s against the model-only forward, in one run.

Same model and options as the catalog's defaults (the embedded DINOv2 ViT-S/14 at 224 px: pooling=mean,
layers=[8], policy=pad). Images: 1600x1200 quality-90 JPEGs made from the photographs bundled with
scikit-image / scikit-learn (``bench.common.images.varied_photo_jpegs``: each copy with its own crop offset,
mirror and mild grain, so files are distinct).

Measured (the machine's speed drifts, so the model-only forward is timed before AND after each round of
catalog runs, and the reference is their median):
- model-only forward (``bench.common.forward``: what the job runs per batch), float32 and (native-bf16 CPUs)
  bfloat16 autocast, at several batch sizes; the best whose vectors keep cosine >= 0.999 to float32;
- ``embed-catalog`` (local engine, a subprocess, as a user runs it) at that batch size and precision, with
  2, 1 and 3 decode threads; images/s from the job's own summary line (first image to last commit);
- ``embed-catalog --engine ray`` (a local 2-CPU Ray cluster started by the job), for information.

Target: catalog images/s >= 0.65 x the model-only forward. Writes bench/results/catalog.{md,json}.

    python -m bench.catalog_bench [--quick] [--out DIR] [--images 240] [--precision auto]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common.forward import (
    ForwardTiming,
    Pixels,
    measured_dtypes,
    pixel_batch,
    run_forward,
    time_forward,
)
from bench.common.images import JPEG_QUALITY, varied_photo_jpegs
from bench.common.machine import bench_lock, machine_info, wait_for_idle
from bench.common.report import add_output_options, fmt, output_dir, quick_note, to_jsonable, write_report
from vit_backbone import Backbone, load_backbone
from vit_backbone.catalog.precision import choose_precision
from vit_backbone.precision import min_cosine

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1600, 1200
TARGET = 0.65
SUMMARY = re.compile(r"^done: (\d+) rows written, (\d+) errors.*?([\d.]+) images/s$", re.M)


@dataclass(frozen=True)
class Sizes:
    images: int
    batch_sizes: tuple[int, ...]
    budget_s: float
    min_runs: int
    rounds: int
    workers: tuple[int, ...]  # decode threads, the default (2) first
    idle_wait_s: float


FULL = Sizes(240, (8, 16, 32), 6.0, 3, 2, (2, 1, 3), 600.0)
QUICK = Sizes(8, (8,), 0.0, 1, 1, (2,), 0.0)


@dataclass(frozen=True)
class Forward:
    """A model-only configuration and how close its vectors stay to float32."""

    timing: ForwardTiming
    min_cosine: float


@dataclass(frozen=True)
class CatalogRun:
    engine: str
    workers: int
    batch_size: int
    precision: str
    rows: int
    errors: int
    images_per_s: float
    wall_s: float  # the subprocess, start-up included
    busy_before: float  # cores busy on the machine just before the run (should be ~0)


@dataclass
class CatalogResults:
    machine: dict[str, Any]
    quick: bool
    images: dict[str, Any]
    model: dict[str, Any]
    precision_rule: str
    forward_before: list[Forward]
    forward_best: Forward
    forward_best_repeats: list[float]  # images/s: before, then after each round
    catalog_runs: list[CatalogRun]
    ray_run: CatalogRun | None
    target: float = TARGET
    mean_by_workers: dict[str, float] = field(default_factory=dict)

    @property
    def reference(self) -> float:
        return statistics.median(self.forward_best_repeats)


# ------------------------------------------------------------------------------------------------ measuring
def bench_forward(backbone: Backbone, pixels: Pixels, sizes: Sizes, precision: str) -> list[Forward]:
    reference = run_forward(backbone, pixels, "float32").numpy()  # [n, F]
    results = []
    for dtype in measured_dtypes(precision):
        cosine = min_cosine(reference, run_forward(backbone, pixels, dtype).numpy())
        for batch_size in sizes.batch_sizes:
            timing = time_forward(
                backbone, pixels, dtype, batch_size, sizes.budget_s, min_runs=sizes.min_runs
            )
            results.append(Forward(timing, cosine))
    backbone.autocast = None
    return results


def run_catalog(
    source: Path, out: Path, engine: str, workers: int, best: ForwardTiming, count: int
) -> CatalogRun:
    argv = [sys.executable, "-m", "vitembed", "embed-catalog", str(source), "--out", str(out)]
    argv += ["--batch-size", str(best.batch_size), "--workers", str(workers), "--precision", best.dtype]
    argv += ["--engine", engine, "--shard-size", "100"]
    busy = wait_for_idle(0.3, 300 if count >= 100 else 0)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    match = SUMMARY.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"embed-catalog failed ({done.returncode}): {done.stderr[-2000:]}")
    rows, errors, rate = int(match.group(1)), int(match.group(2)), float(match.group(3))
    if rows != count or errors:
        raise RuntimeError(f"expected {count} rows and no errors, got {rows} rows and {errors} errors")
    print(
        f"  embed-catalog {engine:5s} workers={workers} bs={best.batch_size} {best.dtype}: {rate:6.1f} img/s"
    )
    return CatalogRun(engine, workers, best.batch_size, best.dtype, rows, errors, rate, wall, busy)


def measure(args: argparse.Namespace, tmp: Path) -> CatalogResults:
    sizes = QUICK if args.quick else FULL
    count = args.images or sizes.images
    folder = tmp / "images"
    print(f"making {count} {WIDTH}x{HEIGHT} JPEGs", flush=True)
    paths = varied_photo_jpegs(folder, count, WIDTH, HEIGHT)
    backbone = load_backbone("embedded")
    wait_for_idle(0.3, sizes.idle_wait_s)
    chosen = choose_precision(backbone, args.precision).label  # the catalog's own rule, on this machine
    pixels = pixel_batch(backbone, [p.read_bytes() for p in paths[:16]])  # [16, 3, 224, 224]
    print(f"model-only forward (the catalog's precision rule picks {chosen}):", flush=True)
    before = bench_forward(backbone, pixels, sizes, args.precision)
    best = max((f for f in before if f.min_cosine >= 0.999), key=lambda f: f.timing.images_per_s)
    runs: list[CatalogRun] = []
    repeats = [best.timing.images_per_s]
    for round_number in range(sizes.rounds):  # interleaved: the machine's speed drifts over minutes
        for workers in sizes.workers:
            out = tmp / f"local-{workers}-{round_number}"
            runs.append(run_catalog(folder, out, "local", workers, best.timing, count))
        wait_for_idle(0.3, 0 if args.quick else 300)
        after = time_forward(
            backbone,
            pixels,
            best.timing.dtype,
            best.timing.batch_size,
            sizes.budget_s,
            min_runs=sizes.min_runs,
        )
        repeats.append(after.images_per_s)
    ray_run = None
    if not args.no_ray and not args.quick:
        try:
            ray_run = run_catalog(folder, tmp / "ray", "ray", 2, best.timing, count)
        except RuntimeError as exc:
            print(f"  ray engine: {exc}", flush=True)
    mean_kb = statistics.mean(p.stat().st_size for p in paths) / 1024
    results = CatalogResults(
        machine=machine_info(),
        quick=args.quick,
        images={
            "count": count,
            "size": f"{WIDTH}x{HEIGHT}",
            "mean_kb": round(mean_kb, 1),
            "quality": JPEG_QUALITY,
        },
        model={"name": "embedded", "revision": backbone.checkpoint.revision, **backbone.info().defaults},
        precision_rule=chosen,
        forward_before=before,
        forward_best=best,
        forward_best_repeats=repeats,
        catalog_runs=runs,
        ray_run=ray_run,
    )
    results.mean_by_workers = {
        str(w): statistics.mean(r.images_per_s for r in runs if r.workers == w) for w in sizes.workers
    }
    return results


# ------------------------------------------------------------------------------------------------ report
def render(results: CatalogResults) -> str:
    m, model, best, reference = results.machine, results.model, results.forward_best.timing, results.reference
    lines = [
        "# `vitembed embed-catalog` benchmark",
        "",
        *quick_note(results.quick),
        f"{m['cpu']} ({m['cores']} cores, load average at start {m['load_average']}), torch {m['torch']}; "
        f"model `embedded` (DINOv2 ViT-S/14) at 224 px with its defaults (pooling={model['pooling']}, "
        f"layers={model['layers']}, policy={model['policy']}); {results.images['count']} JPEGs "
        f"{results.images['size']}, mean {results.images['mean_kb']} KB, quality "
        f"{results.images['quality']}. The catalog's precision rule picked {results.precision_rule}. "
        "Produced by `python -m bench.catalog_bench`.",
        "",
        "| path | batch | precision | images/s | vs model-only forward | target |",
        "|---|---|---|---|---|---|",
    ]
    for f in results.forward_before:
        t = f.timing
        lines.append(
            f"| model-only forward | {t.batch_size} | {t.dtype} (cos {f.min_cosine:.5f}) | "
            f"{fmt(t.images_per_s)} | | |"
        )
    repeats = ", ".join(f"{v:.1f}" for v in results.forward_best_repeats)
    lines.append(
        f"| **reference**: best forward, median of before + after each round ({repeats}) | "
        f"{best.batch_size} | {best.dtype} | {fmt(reference)} | 1.00x | |"
    )
    for workers, mean in results.mean_by_workers.items():
        rates = ", ".join(f"{r.images_per_s:.1f}" for r in results.catalog_runs if str(r.workers) == workers)
        mark = "PASS" if mean / reference >= TARGET else "FAIL"
        note = " (default)" if workers == "2" else ""
        lines.append(
            f"| embed-catalog local, {workers} decode thread(s){note}: mean of {rates} | {best.batch_size} | "
            f"{best.dtype} | {fmt(mean)} | {mean / reference:.2f}x | ≥ {TARGET}x {mark} |"
        )
    if results.ray_run is not None:
        r = results.ray_run
        lines.append(
            f"| embed-catalog --engine ray (local 2-CPU cluster, info) | {r.batch_size} | {r.precision} | "
            f"{fmt(r.images_per_s)} | {r.images_per_s / reference:.2f}x | |"
        )
    lines += [
        "",
        "Catalog images/s is the job's own summary (first image to last shard commit: read + draft decode + "
        "preprocess on worker threads overlapping the forward passes, Parquet writes included; model loading "
        "and the precision probe excluded).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.catalog_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_output_options(parser)
    parser.add_argument("--images", type=int, default=None, help="JPEGs to embed (default 240; --quick 8)")
    parser.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray engine run (--quick always does)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = output_dir(args, "catalog")
    with (
        bench_lock("catalog_bench", enabled=not args.quick),
        tempfile.TemporaryDirectory(prefix="catalog-") as tmp,
    ):
        results = measure(args, Path(tmp))
    summary = {"forward_reference": results.reference, "ratio_default": _ratio_default(results)}
    write_report(out, "catalog", {**to_jsonable(results), **summary}, render(results))
    return 0


def _ratio_default(results: CatalogResults) -> float:
    return results.mean_by_workers["2"] / results.reference


if __name__ == "__main__":
    raise SystemExit(main())
