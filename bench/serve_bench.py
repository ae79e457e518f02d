"""Throughput and latency of ``vitembed serve`` against the model-only forward and the transformers pipeline.

One run, the same JPEGs everywhere, the embedded backbone (DINOv2 ViT-S/14) at its defaults (224 px,
pooling=mean, layers=[8], policy=pad: whatever the server does with no options):

1. JPEG sets: ``photos`` (the colour photos bundled with scikit-image / scikit-learn, cover-cropped to 4:3 and
   resized to 1600x1200, quality 90: what a user's catalog looks like) and ``noise`` (uniform random pixels
   at 1600x1200, the worst case for entropy decoding). ``--sets`` adds ``photos-640x480`` / ``noise-640x480``.
2. Model-only: what the server runs (``Backbone.pooled`` with the defaults, which stops after block 8, then
   ``.float()``) on pre-made 224 px pixels, batch sizes 1 / 8 / 32, float32 and (native-bf16 CPUs) bfloat16.
3. Decode + preprocess on one thread (the server's path, JPEG draft included), for the serial estimate.
4. ``transformers.pipeline("image-feature-extraction", batch_size=8)`` on the JPEG files (float32).
5. ``vitembed serve`` as a subprocess on 127.0.0.1, loaded by ``bench.common.loadgen`` in a process of its own
   (closed-loop clients, one keep-alive connection each, single-image multipart requests): one sequential
   client, then N concurrent clients for a fixed time; images/s, p50/p99, the CPU of the client process, the
   server and everything else, and the server's /metrics per scenario.

The VM's speed drifts by tens of percent over minutes, so each set's ratios use references timed next to its
scenarios (server idle): bs=1 forwards interleaved with the sequential requests, the best batch and the
pipeline before and after the concurrent scenarios. A measurement during which other processes used more
than a quarter core is taken again.

Targets (issue 3), for the 1600x1200 photos: serve >= 3x the pipeline and >= 0.6x the best model-only
forward; single-image p50 <= 1.5x one bs=1 forward at the server's precision. Writes
``bench/results/serve.md`` and ``serve.json`` (``--quick``: a smoke run into a temporary folder).

    python -m bench.serve_bench [--quick] [--out DIR] [--server-arg=--max-wait-ms=10 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.common.forward import ForwardTiming, measured_dtypes, pixel_batch, time_forward
from bench.common.images import JpegSet, noise_jpegs, photo_jpegs
from bench.common.loadgen import LoadGenerator
from bench.common.machine import bench_lock, machine_info, wait_for_idle
from bench.common.report import add_output_options, output_dir, to_jsonable, write_report
from bench.common.server import ServerProcess
from bench.serve_measure import (
    AdjacentReferences,
    DecodeTiming,
    PipelineTiming,
    Scenario,
    ServeResults,
    SetPlan,
    SetResult,
    make_pipeline,
    measure_set,
    quiet,
    time_decode,
    time_pipeline,
)
from bench.serve_report import render, targets
from vit_backbone import Backbone, load_backbone
from vit_backbone.embedded import ensure_embedded_checkpoint

SETS = {
    "photos-1600x1200": ("photos", 1600, 1200),
    "noise-1600x1200": ("noise", 1600, 1200),
    "photos-640x480": ("photos", 640, 480),
    "noise-640x480": ("noise", 640, 480),
}
DEFAULT_SETS = ["photos-1600x1200", "noise-1600x1200"]


@dataclass(frozen=True)
class Sizes:
    """How much to measure: the full run, or the ``--quick`` smoke run (numbers meaningless, seconds)."""

    photos: int | None  # photos per set (None: all 8)
    noise: int  # noise JPEGs per set
    batch_sizes: tuple[int, ...]  # start-of-run model-only table
    forward_budget_s: float  # per start-of-run forward configuration
    min_runs: int  # timed forward passes at least
    reference_budget_s: float  # per adjacent forward reference
    decode_budget_s: float
    pipeline_images: int
    concurrency: tuple[int, ...]
    duration_s: float  # per concurrent scenario
    sequential: int  # sequential requests, in ``blocks`` blocks
    blocks: int
    retries: int  # re-measurements of a noisy measurement
    idle_wait_s: float  # waiting for a quiet machine at the start


FULL = Sizes(None, 8, (1, 8, 32), 5.0, 3, 3.0, 3.0, 48, (8, 16), 15.0, 40, 4, 2, 900.0)
QUICK = Sizes(2, 1, (1, 4), 0.0, 1, 0.0, 0.2, 2, (2,), 1.0, 2, 1, 0, 0.0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_output_options(parser)
    parser.add_argument("--duration", type=float, default=None, help="seconds per concurrent scenario")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=None, help="client counts (default 8 16)"
    )
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=DEFAULT_SETS, help="JPEG sets")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `vitembed serve` flag, e.g. --server-arg=--max-wait-ms=10",
    )
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the server process only, e.g. VITEMBED_DECODE_WORKERS=1",
    )
    parser.add_argument("--server-cpus", default=None, help="taskset CPU list for the server (default: none)")
    parser.add_argument(
        "--max-idle-wait", type=float, default=None, help="seconds to wait for a quiet machine"
    )
    return parser.parse_args(argv)


def sizes_for(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else FULL
    return replace(
        sizes,
        duration_s=args.duration or sizes.duration_s,
        concurrency=tuple(args.concurrency or sizes.concurrency),
        idle_wait_s=sizes.idle_wait_s if args.max_idle_wait is None else args.max_idle_wait,
    )


def make_sets(folder: Path, names: Sequence[str], sizes: Sizes) -> list[JpegSet]:
    out = []
    for name in names:
        kind, width, height = SETS[name]
        if kind == "photos":
            out.append(photo_jpegs(folder, width, height, count=sizes.photos))
        else:
            out.append(noise_jpegs(folder, width, height, count=sizes.noise))
        facts = out[-1].facts()
        print(f"  {out[-1].label}: {facts['count']} JPEGs, mean {facts['mean_kb']:.0f} KB", flush=True)
    return out


@dataclass
class StartOfRun:
    """References timed before the server starts."""

    forward: list[ForwardTiming]
    decode: dict[str, DecodeTiming]
    pipeline: dict[str, PipelineTiming]


def _noise(timing: ForwardTiming | PipelineTiming) -> float:
    return timing.background_cores


def start_of_run(backbone: Backbone, sets: Sequence[JpegSet], pipe: Any, sizes: Sizes) -> StartOfRun:
    pixels = pixel_batch(backbone, sets[0].bodies())  # [n, 3, 224, 224]

    def forward(dtype: str, batch: int) -> ForwardTiming:
        return time_forward(backbone, pixels, dtype, batch, sizes.forward_budget_s, min_runs=sizes.min_runs)

    return StartOfRun(
        forward=[
            quiet(partial(forward, d, b), _noise, "forward", sizes.retries)[0]
            for d in measured_dtypes()
            for b in sizes.batch_sizes
        ],
        decode={s.label: time_decode(backbone, s.bodies(), sizes.decode_budget_s) for s in sets},
        pipeline={
            s.label: quiet(
                partial(time_pipeline, pipe, s, sizes.pipeline_images),
                _noise,
                "pipeline",
                sizes.retries,
            )[0]
            for s in sets
        },
    )


def measure(args: argparse.Namespace, work: Path) -> ServeResults:
    sizes = sizes_for(args)
    started = time.monotonic()
    busy = wait_for_idle(0.3, sizes.idle_wait_s)
    machine = machine_info()
    sets = make_sets(work, args.sets, sizes)
    backbone = load_backbone("embedded")
    d = backbone.defaults
    defaults = f"pooling={d.pooling}, layers={list(d.layers) if d.layers else None}, policy={d.policy}"
    pipe = make_pipeline(ensure_embedded_checkpoint())
    print(f"references ({defaults}) ...", flush=True)
    start = start_of_run(backbone, sets, pipe, sizes)
    server_env = dict(item.split("=", 1) for item in args.server_env)
    print("vitembed serve ...", flush=True)
    log = work / "server.log"
    with ServerProcess(args.server_arg, log_path=log, env=server_env, cpus=args.server_cpus) as server:
        try:
            ready_s = server.wait_ready(300)
            precision = str(server.model_info().get("info", {}).get("precision", "?"))
            served_dtype = "bfloat16" if "bfloat16" in precision else "float32"
            print(f"  ready in {ready_s:.1f} s, precision: {precision}", flush=True)
            measured = _measure_sets(server, backbone, pipe, sets, start.forward, served_dtype, sizes)
        except BaseException:
            print(server.log_tail(), file=sys.stderr)
            raise
    env = {k: v for k, v in os.environ.items() if k.startswith(("VITEMBED_", "OMP_"))}
    pinning = f"server pinned to CPUs {args.server_cpus}" if args.server_cpus else "no pinning"
    return ServeResults(
        machine=machine,
        quick=args.quick,
        defaults=defaults,
        server={
            "precision": precision,
            "served_dtype": served_dtype,
            "ready_s": ready_s,
            "args": list(args.server_arg),
            "env": {**env, **server_env},
            "cpus": args.server_cpus,
            "command": server.command,
        },
        client_note=f"{sizes.duration_s:g} s per concurrent scenario; {pinning} (2 cores shared).",
        model_only=start.forward,
        sets=[
            SetResult(s.label, s.facts(), start.decode[s.label], start.pipeline[s.label], refs, scenarios)
            for s, (refs, scenarios) in zip(sets, measured, strict=True)
        ],
        busy_cores_at_start=busy,
        wall_s=time.monotonic() - started,
    )


def _measure_sets(
    server: ServerProcess,
    backbone: Backbone,
    pipe: Any,
    sets: Sequence[JpegSet],
    forward: Sequence[ForwardTiming],
    served_dtype: str,
    sizes: Sizes,
) -> list[tuple[AdjacentReferences, list[Scenario]]]:
    best = max(forward, key=lambda f: f.images_per_s)
    pixels = pixel_batch(backbone, sets[0].bodies())  # [n, 3, 224, 224]
    plan = SetPlan(
        concurrency=sizes.concurrency,
        duration_s=sizes.duration_s,
        sequential=sizes.sequential,
        blocks=sizes.blocks,
        budget_s=sizes.reference_budget_s,
        best_batches=sorted({1, *sizes.batch_sizes[1:2], best.batch_size}),
        best_dtype=best.dtype,
        served_dtype=served_dtype,
        retries=sizes.retries,
    )

    def forward_ref(dtype: str, batch_size: int, budget_s: float) -> ForwardTiming:
        return time_forward(
            backbone, pixels, dtype, batch_size, budget_s, "reference ", min_runs=sizes.min_runs
        )

    def pipeline_ref(jpegs: JpegSet) -> PipelineTiming:
        return time_pipeline(pipe, jpegs, sizes.pipeline_images, "reference ")

    with LoadGenerator() as load:
        return [measure_set(server, load, s, plan, forward_ref, pipeline_ref) for s in sets]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = output_dir(args, "serve")
    with (
        bench_lock("serve_bench", enabled=not args.quick),
        tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp,
    ):
        results = measure(args, Path(tmp))
    write_report(out, "serve", {**to_jsonable(results), "targets": targets(results)}, render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
