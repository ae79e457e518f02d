"""Where ``vitembed serve`` (the embedded default) spends its time to ``/ready``, against a bare
``import torch, transformers`` in a fresh interpreter (the floor any Python server of these models pays).

    python -m bench.startup            # 3 starts each, median; into bench/results/startup.{json,md}
    python -m bench.startup --quick    # 1 start each, into a temporary folder

Each start is a fresh ``python -m vitembed serve`` (as a user or a pod runs it) after the one-time conversion
of the embedded checkpoint (done once before timing). The breakdown comes from the server's own log:
``imports`` = process start to the engine's first log line (Python, torch, the web framework, the settings
and app; DINOv2 runs without transformers' model code, see vit_backbone/native_dinov2.py), then the model's
``load``, ``precision`` (the auto decision: measured, or read from its cache) and ``warm-up`` (one timed
batch that seeds admission), and ``http`` = the rest until ``/ready`` answered (uvicorn binding, the first
poll). The target: ready minus the bare import at most 2 s.

Two kinds of start are reported: a restart (the precision decision is in the cache volume, as for a
restarted or rescheduled pod of the same machine class: the median of ``--runs``), and the first start on
a machine class (the decision removed from the cache first: one start; on a CPU without native bfloat16
there is nothing to measure, so the two differ only by noise).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from vitembed.engine.precision_cache import CACHE_FILE

from bench.common.machine import machine_info
from bench.common.report import add_output_options, fmt, output_dir, write_report
from bench.common.server import ROOT, free_port

TARGET_OVER_BARE_S = 2.0
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_READY = re.compile(
    r"model (\S+) ready in ([\d.]+) s \(load ([\d.]+) s, precision ([\d.]+) s, warm-up ([\d.]+) s; ([^)]*)\)"
)


@dataclass
class Start:
    ready_s: float
    imports_s: float
    load_s: float
    precision_s: float
    warmup_s: float
    http_s: float
    precision: str


BARE = "import torch, transformers"
# transformers imports a model's module lazily, on first use: that import (torch._dynamo, torch.distributed
# tensor ops, its loss and kernel registries) is paid by any server of the model, so it is measured too
MODEL_CLASS = BARE + "; transformers.Dinov2Model"


def bare_import_s(code: str = BARE) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return time.perf_counter() - started


def _stamp(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_start(log_path: Path, timeout_s: float = 300) -> Start:
    port = free_port()
    command = [sys.executable, "-m", "vitembed", "serve", "--port", str(port), "--log-level", "info"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log_path.open("wb") as log:
        wall0, started = time.time(), time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = _wait_ready(proc, port, started, timeout_s)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    lines = log_path.read_text(errors="replace").splitlines()
    first = next(s for s in map(_stamp, lines) if s is not None)  # the engine's first line (torch threads)
    match = next(m for m in map(_READY.search, lines) if m is not None)
    load, precision, warmup = (float(match.group(i)) for i in (3, 4, 5))
    imports = first - wall0
    return Start(
        ready_s=ready,
        imports_s=imports,
        load_s=load,
        precision_s=precision,
        warmup_s=warmup,
        http_s=ready - imports - float(match.group(2)),
        precision=match.group(6),
    )


def _wait_ready(proc: subprocess.Popen[bytes], port: int, started: float, timeout_s: float) -> float:
    with httpx.Client(timeout=2.0) as client:
        while time.perf_counter() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"vitembed serve exited with {proc.returncode}")
            try:
                if client.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"not ready within {timeout_s:.0f} s")


def measure(runs: int, work: Path) -> dict[str, Any]:
    from vit_backbone.embedded import ensure_embedded_checkpoint

    checkpoint = ensure_embedded_checkpoint()  # the one-time conversion is not part of a start
    one_start(work / "serve-warm.log")  # fills the OS page cache
    (checkpoint.parent.parent / CACHE_FILE).unlink(missing_ok=True)  # a machine class not seen before
    first = one_start(work / "serve-first.log")
    bare = [bare_import_s() for _ in range(runs)]
    model_class = [bare_import_s(MODEL_CLASS) for _ in range(runs)]
    starts = [one_start(work / f"serve-{n}.log") for n in range(runs)]
    median = {
        field: statistics.median(getattr(s, field) for s in starts)
        for field in ("ready_s", "imports_s", "load_s", "precision_s", "warmup_s", "http_s")
    }
    bare_s = statistics.median(bare)
    return {
        "bare_import_s": bare_s,
        "bare_runs": bare,
        "model_class_import_s": statistics.median(model_class),
        "over_model_class_s": median["ready_s"] - statistics.median(model_class),
        "starts": starts,
        "first_start": first,
        "first_over_bare_s": first.ready_s - bare_s,
        "median": median,
        "over_bare_s": median["ready_s"] - bare_s,
        "target_over_bare_s": TARGET_OVER_BARE_S,
        "precision": starts[-1].precision,
    }


def render(results: dict[str, Any]) -> str:
    med = results["median"]
    quick = " (--quick: one start, numbers of a smoke run)" if results["quick"] else ""
    first = results["first_start"]
    rows = [
        ("bare `import torch, transformers`", results["bare_import_s"]),
        ("`vitembed serve` to /ready", med["ready_s"]),
        ("  imports, settings, app (to the engine's first line)", med["imports_s"]),
        ("  model load (embedded, converted)", med["load_s"]),
        ("  precision decision", med["precision_s"]),
        ("  warm-up batch", med["warmup_s"]),
        ("  HTTP up and first /ready", med["http_s"]),
        ("ready minus bare import", results["over_bare_s"]),
        ("bare import + `transformers.Dinov2Model` (the model's module)", results["model_class_import_s"]),
        ("ready minus that", results["over_model_class_s"]),
        ("first start on this machine class: to /ready", first.ready_s),
        ("  its precision decision", first.precision_s),
        ("  its ready minus bare import", results["first_over_bare_s"]),
    ]
    table = "\n".join(f"| {name} | {fmt(value, 2)} |" for name, value in rows)
    return (
        f"# vitembed serve: time to ready{quick}\n\n"
        f"Median of {len(results['starts'])} fresh starts of `vitembed serve` "
        f"(embedded, {results['precision']}); "
        f"target: ready minus the bare import ≤ {TARGET_OVER_BARE_S:g} s.\n\n"
        f"| stage | seconds |\n|---|---|\n{table}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_options(parser)
    parser.add_argument("--runs", type=int, default=None, help="starts per measurement (default 3, 1 quick)")
    args = parser.parse_args(argv)
    out = output_dir(args, "startup")
    runs = args.runs or (1 if args.quick else 3)
    results = {"machine": machine_info(), "quick": args.quick, **measure(runs, out)}
    write_report(out, "startup", results, render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
