"""What to embed: a folder of images or a manifest (CSV, JSONL, Parquet with ``id`` and ``path``).

Both become one ordered list of ``SourceItem`` with unique ids, so every engine and a resumed run see the
same items in the same order. A folder is walked recursively, keeps the image extensions only, and names
each image by its POSIX path relative to the folder (sorted, so the order does not depend on the file
system). A manifest keeps its own row order; relative paths are resolved against the manifest's folder;
any other column is carried into the shards as a string.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vit_backbone.errors import MissingExtraError

from .errors import SourceError

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
MANIFEST_SUFFIXES = (".csv", ".jsonl", ".parquet")
REQUIRED = ("id", "path")


@dataclass(frozen=True)
class SourceItem:
    id: str
    path: str  # absolute
    extra: tuple[str, ...] = ()  # values of Source.extra_columns, in that order


@dataclass(frozen=True)
class Source:
    location: str  # the resolved folder or manifest file
    kind: str  # "folder" | "csv" | "jsonl" | "parquet"
    items: list[SourceItem]
    extra_columns: tuple[str, ...] = ()


def open_source(location: str | Path) -> Source:
    """A folder or a manifest file → its items; raises ``SourceError`` with what to fix."""
    path = Path(location).expanduser()
    if path.is_dir():
        return _folder(path.resolve())
    if not path.exists():
        raise SourceError(f"source {location} does not exist (give a folder of images or a manifest file)")
    suffix = path.suffix.lower()
    if suffix not in MANIFEST_SUFFIXES:
        raise SourceError(
            f"source {location} is neither a folder nor a manifest: manifests end in "
            f"{', '.join(MANIFEST_SUFFIXES)} and have 'id' and 'path' columns"
        )
    path = path.resolve()
    kind = suffix.lstrip(".")
    rows, columns = {"csv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet}[kind](path)
    return _from_rows(path, kind, rows, columns)


def _folder(root: Path) -> Source:
    items = [
        SourceItem(id=p.relative_to(root).as_posix(), path=str(p))
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
    ]
    items.sort(key=lambda item: item.id)
    if not items:
        raise SourceError(
            f"folder {root} holds no images (looked for {', '.join(sorted(IMAGE_EXTENSIONS))}, recursively)"
        )
    return Source(location=str(root), kind="folder", items=items)


def _read_csv(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"{path} is not a readable UTF-8 CSV file: {exc}") from exc
    for line, row in enumerate(rows, start=2):
        if None in row:  # more fields than the header names
            raise SourceError(f"{path}:{line}: more fields than the header has columns")
    return rows, columns


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    columns: dict[str, None] = {}  # first-seen order
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text: {exc}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}:{number}: not a JSON object: {exc}") from exc
        if not isinstance(row, dict):
            raise SourceError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        columns.update(dict.fromkeys(row))
        rows.append(row)
    return rows, list(columns)


def _read_parquet(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtraError("a Parquet manifest", "catalog") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise SourceError(f"{path} is not a readable Parquet file: {exc}") from exc
    return table.to_pylist(), list(table.column_names)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return json.dumps(value, default=str, sort_keys=True)


def _from_rows(path: Path, kind: str, rows: list[dict[str, Any]], columns: list[str]) -> Source:
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise SourceError(f"manifest {path} lacks the column(s) {', '.join(missing)}; it has {columns}")
    if not rows:
        raise SourceError(f"manifest {path} has no rows")
    extra_columns = tuple(c for c in columns if c not in REQUIRED)
    items = []
    for number, row in enumerate(rows, start=1):
        item_id, item_path = row.get("id"), row.get("path")
        if not isinstance(item_id, str | int) or isinstance(item_id, bool) or str(item_id) == "":
            raise SourceError(f"manifest {path}, row {number}: 'id' must be a non-empty string")
        if not isinstance(item_path, str) or not item_path:
            raise SourceError(f"manifest {path}, row {number}: 'path' must be a non-empty string")
        resolved = Path(item_path).expanduser()
        if not resolved.is_absolute():
            resolved = path.parent / resolved
        extra = tuple(_text(row.get(c)) for c in extra_columns)
        items.append(SourceItem(id=str(item_id), path=str(resolved), extra=extra))
    counts = Counter(item.id for item in items)
    duplicates = [i for i, n in counts.items() if n > 1]
    if duplicates:
        shown = ", ".join(repr(d) for d in duplicates[:5]) + (" …" if len(duplicates) > 5 else "")
        raise SourceError(
            f"manifest {path} has {len(duplicates)} duplicate id(s): {shown}; ids must be unique "
            "(they are the catalog's keys, and a resumed job skips ids already done)"
        )
    return Source(location=str(path), kind=kind, items=items, extra_columns=extra_columns)
