"""Results → ``<out>/<name>.json`` + ``<out>/<name>.md``, kept apart from measuring.

Each bench measures into a results dataclass, renders Markdown from it in a function of its own, and calls
``write_report``. ``--quick`` (a smoke run) writes into a fresh temporary folder unless ``--out`` names one:
it never overwrites the committed ``bench/results``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny sizes, a minute or less, no bench lock, no waiting for a quiet machine; "
        "writes into a temporary folder unless --out is given",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"results folder (default {RESULTS})")


def output_dir(args: argparse.Namespace, name: str) -> Path:
    """``--out``, else a temporary folder for ``--quick``, else ``bench/results``; created."""
    out: Path = args.out or (Path(tempfile.mkdtemp(prefix=f"{name}-quick-")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    return out


def to_jsonable(value: Any) -> Any:
    """Dataclasses → dicts, NaN/inf → null, numpy scalars → Python, paths → str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def write_report(out_dir: Path, name: str, results: Any, markdown: str) -> tuple[Path, Path]:
    """Write ``name.json`` (the results, JSON-safe) and ``name.md``; print the Markdown."""
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(to_jsonable(results), indent=2, allow_nan=False) + "\n")
    md_path.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    print(markdown, flush=True)
    print(f"wrote {md_path} and {json_path.name}", flush=True)
    return json_path, md_path


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; ``–`` for missing or NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile, NaN when there are no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else math.nan


def quick_note(quick: bool) -> list[str]:
    """A banner for smoke-run reports, whose numbers mean nothing."""
    return ["**Quick smoke run (`--quick`): tiny sizes, numbers not meaningful.**", ""] if quick else []
