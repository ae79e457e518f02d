"""A copy of parts of this repository in a temporary folder, for tests that must not write into the
checkout (building a wheel) or must change the sources (planting type errors)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def copy_sources(names: Iterable[str], dest: Path) -> Path:
    """Copy the files and folders ``names`` (relative to the repository root) into ``dest``, without
    bytecode; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, dest / name)
    return dest
