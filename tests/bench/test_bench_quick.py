"""Every bench runs in ``--quick`` mode and writes its report: a bench that no longer runs fails here.

Each bench runs as a user runs it (``python -m bench.<name> --quick --out DIR`` from the repository root, a
subprocess); the test checks the exit status, that the JSON and Markdown reports exist in ``--out`` (never in
the committed ``bench/results``) and that the JSON has the keys the README and the Markdown are built from.
No timing is asserted: the numbers of a smoke run on a shared machine mean nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

# bench module → (report name, top-level JSON keys, needs Fashion-MNIST)
BENCHES: dict[str, tuple[str, set[str], bool]] = {
    "serve_bench": (
        "serve",
        {"machine", "quick", "defaults", "server", "model_only", "sets", "targets", "wall_s"},
        False,
    ),
    "catalog_bench": (
        "catalog",
        {"machine", "quick", "images", "forward_before", "forward_best", "catalog_runs", "forward_reference"},
        False,
    ),
    "copy_detection": (
        "copy_detection",
        {"config", "quick", "variants", "gallery", "queries_per_transform", "curves", "candidates"},
        False,
    ),
    "search_bench": ("search", {"machine", "quick", "rows", "build_s", "exact", "ann"}, False),
    "startup": (
        "startup",
        {"machine", "quick", "bare_import_s", "model_class_import_s", "median", "over_bare_s", "starts"},
        False,
    ),
    "heads_quality": ("heads", {"machine", "quick", "setup", "rows"}, True),
    "heads_precision": (
        "heads_precision",
        {"machine", "quick", "feature_cosine_min", "linear", "knn"},
        True,
    ),
}


def run_quick(module: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", f"bench.{module}", "--quick", "--out", str(out)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(BENCHES))
def test_bench_runs_quick_and_writes_its_report(module: str, tmp_path: Path) -> None:
    name, keys, needs_fashion = BENCHES[module]
    if needs_fashion and not FASHION_DIR.is_dir():
        pytest.skip(f"Fashion-MNIST is not installed ({FASHION_DIR}; Debian package dataset-fashion-mnist)")
    committed = {p: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").glob(f"{name}.*")}
    done = run_quick(module, tmp_path)
    assert done.returncode == 0, f"{module} --quick failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert keys <= set(data), f"missing keys: {sorted(keys - set(data))}"
    assert data.get("quick", True) is True
    markdown = (tmp_path / f"{name}.md").read_text()
    assert markdown.startswith("# ") and "--quick" in markdown
    now = {p: p.stat().st_mtime_ns for p in (ROOT / "bench" / "results").glob(f"{name}.*")}
    assert now == committed, "a --quick run touched the committed bench/results"
