"""mypy, run with the project's own configuration, really sees the packages: deliberate type errors planted
in a temporary copy of the tree are reported. With ``ignore_missing_imports`` on, a package mypy cannot
resolve (a folder remapped to another import name, a wrong ``mypy_path``) is silently typed ``Any`` and
every call into it passes; the cross-package errors below would then go unreported.

Planted: a plain error in a ``vit_backbone`` module and one in a ``vitembed`` module; a ``vitembed`` module
calling ``vit_backbone`` and another ``vitembed`` module with wrong argument types (only reported if both
resolve); the same for ``vitembed_client``. The project's ``.mypy_cache`` is copied along when there is one
(third-party stubs are then not analysed again: ~15 s instead of ~60 s).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from source_tree import ROOT, copy_sources

TREE = ["pyproject.toml", "vit_backbone", "service", "client", "bench"]

pytestmark = pytest.mark.slow

# (file, text appended, the error mypy must report on that line)
PLANTED = [
    ("vit_backbone/pooling.py", '_PLANTED_LIBRARY: int = "not an int"', "Incompatible types in assignment"),
    ("service/vitembed/settings.py", "_PLANTED_SERVICE: bytes = 3.5", "Incompatible types in assignment"),
    (
        "service/vitembed/server/plumbing.py",
        'from vit_backbone.preprocess import check_token_budget as _ctb\n_ctb("8x8", 64, "a grid")',
        'Argument 1 to "check_token_budget" has incompatible type "str"',
    ),
    (
        "service/vitembed/cli/serve.py",
        "from vitembed.settings import split_index_target as _sit\n_sit(42)",
        'Argument 1 to "split_index_target" has incompatible type "int"',
    ),
    (
        "client/vitembed_client/errors.py",
        '_PLANTED_CLIENT: list[int] = ["a"]',
        'List item 0 has incompatible type "str"',
    ),
]


def _copy(tmp_path: Path) -> Path:
    tree = copy_sources(TREE, tmp_path / "tree")
    if (ROOT / ".mypy_cache").is_dir():
        shutil.copytree(ROOT / ".mypy_cache", tree / ".mypy_cache")
    return tree


def test_mypy_reports_errors_planted_in_every_package(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    tree = _copy(tmp_path)
    lines: dict[str, int] = {}
    for relative, text, _ in PLANTED:
        path = tree / relative
        source = path.read_text()
        if not source.endswith("\n"):
            source += "\n"
        path.write_text(source + text + "\n")
        lines[relative] = len(source.splitlines()) + len(text.splitlines())  # the last planted line
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--show-error-codes", "--no-pretty"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 1, report  # 1: type errors found (2 would be a crash or a bad config)
    for relative, _, message in PLANTED:
        pattern = rf"^{re.escape(relative)}:{lines[relative]}: error: {re.escape(message)}"
        assert re.search(pattern, report, re.MULTILINE), f"not reported: {relative}: {message}\n{report}"
    errors = [line for line in report.splitlines() if ": error:" in line]
    assert len(errors) == len(PLANTED), "errors beyond the planted ones:\n" + report
