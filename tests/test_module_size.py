"""No module of the packages above 500 lines: a file past that is split along its seam (a module per
concept) before it grows further. Counts every line, blank and comment lines included, as ``wc -l`` does."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = [ROOT / "vit_backbone", ROOT / "service" / "vitembed", ROOT / "client" / "vitembed_client"]
MAX_LINES = 500


def line_counts() -> dict[str, int]:
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_bytes().splitlines())
        for folder in FOLDERS
        for path in sorted(folder.rglob("*.py"))
    }


def test_no_module_above_500_lines() -> None:
    counts = line_counts()
    assert len(counts) > 90, f"only {len(counts)} modules found: are the folders right?"
    offenders = {path: lines for path, lines in counts.items() if lines > MAX_LINES}
    assert not offenders, f"modules above {MAX_LINES} lines (split them along a seam): " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(offenders.items(), key=lambda item: -item[1])
    )
