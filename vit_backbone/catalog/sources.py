"""What to embed: a folder of images or a manifest (CSV, JSONL, Parquet with ``id`` and ``path``).

Both become one ordered list of ``SourceItem`` with unique ids, so every engine and a resumed run see the
same items in the same order. A folder is walked recursively, keeps the image extensions only, and names
each image by its POSIX path relative to the folder (sorted, so the order does not depend on the file
system). A manifest keeps its own row order; relative paths are resolved against the manifest's folder;
any other column is carried into the shards as a string. Manifests are read row by row (Parquet in
record batches), so only the items, not the parsed file, are held in memory.

An id that cannot be written as UTF-8 (a file name with undecodable bytes, a lone surrogate in JSON) is
kept as an item marked ``invalid``, its id spelled with backslash escapes: the job records it in
errors.jsonl as ``invalid_name`` instead of crashing when it writes the id.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vit_backbone.catalog.errors import SourceError
from vit_backbone.errors import MissingExtraError

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
MANIFEST_SUFFIXES = (".csv", ".jsonl", ".parquet")
REQUIRED = ("id", "path")
RESERVED = ("embedding",)  # the shards' vector column: a manifest column may not take its name
PARQUET_BATCH_ROWS = 65_536
INVALID_NAME = "the name is not valid UTF-8 (shown with backslash escapes); rename the file or fix the id"

Rows = Iterator[dict[str, Any]]


@dataclass(frozen=True)
class SourceItem:
    id: str
    path: str  # absolute
    extra: tuple[str, ...] = ()  # values of Source.extra_columns, in that order
    invalid: str = ""  # why this item cannot be embedded at all (recorded as ``invalid_name``)


@dataclass(frozen=True)
class Source:
    location: str  # the resolved folder or manifest file
    kind: str  # "folder" | "csv" | "jsonl" | "parquet"
    items: list[SourceItem]
    extra_columns: tuple[str, ...] = ()


def safe_text(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (surrogates) spelled as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    columns, rows = {"csv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet}[kind](path)
    return _from_rows(path, kind, columns, rows)


def _folder(root: Path) -> Source:
    items = []
    for p in root.rglob("*"):
        if p.suffix.lower() not in IMAGE_EXTENSIONS or not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        safe = safe_text(rel)
        invalid = "" if safe == rel else f"file {safe_text(str(p))}: {INVALID_NAME}"
        items.append(SourceItem(id=safe, path=safe_text(str(p)), invalid=invalid))
    items.sort(key=lambda item: item.id)
    if not items:
        raise SourceError(
            f"folder {root} holds no images (looked for {', '.join(sorted(IMAGE_EXTENSIONS))}, recursively)"
        )
    return Source(location=str(root), kind="folder", items=items)


def _read_csv(path: Path) -> tuple[list[str], Rows]:
    def rows(header_only: bool = False) -> Iterator[Any]:
        try:
            with path.open(newline="", encoding="utf-8-sig") as handle:
                reader = csv.DictReader(handle)
                if header_only:
                    yield list(reader.fieldnames or [])
                    return
                for line, row in enumerate(reader, start=2):
                    if None in row:  # more fields than the header names
                        raise SourceError(f"{path}:{line}: more fields than the header has columns")
                    yield row
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SourceError(f"{path} is not a readable UTF-8 CSV file: {exc}") from exc

    return next(rows(header_only=True)), rows()


def _jsonl_rows(path: Path) -> Rows:
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SourceError(f"{path}:{number}: not a JSON object: {exc}") from exc
                if not isinstance(row, dict):
                    raise SourceError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
                yield row
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text: {exc}") from exc


def _read_jsonl(path: Path) -> tuple[list[str], Rows]:
    """Two passes: the first finds every column (first-seen order) without keeping the rows."""
    columns: dict[str, None] = {}
    for row in _jsonl_rows(path):
        columns.update(dict.fromkeys(row))
    return list(columns), _jsonl_rows(path)


def _read_parquet(path: Path) -> tuple[list[str], Rows]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtraError("a Parquet manifest", "catalog") from exc
    try:
        manifest = pq.ParquetFile(path)
        columns = list(manifest.schema_arrow.names)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise SourceError(f"{path} is not a readable Parquet file: {exc}") from exc

    def rows() -> Rows:
        try:
            for batch in manifest.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                yield from batch.to_pylist()
        except (OSError, ValueError) as exc:
            raise SourceError(f"{path} is not a readable Parquet file: {exc}") from exc

    return columns, rows()


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return safe_text(json.dumps(value, default=str, sort_keys=True))


def _check_columns(path: Path, columns: list[str]) -> None:
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise SourceError(f"manifest {path} lacks the column(s) {', '.join(missing)}; it has {columns}")
    repeated = sorted(c for c, n in Counter(columns).items() if n > 1)
    if repeated:
        raise SourceError(f"manifest {path} names the column(s) {', '.join(repeated)} more than once")
    reserved = [c for c in columns if c in RESERVED]
    if reserved:
        raise SourceError(
            f"manifest {path} has a column named {', '.join(reserved)}, which the catalog keeps for the "
            "vectors; rename that column"
        )


def _from_rows(path: Path, kind: str, columns: list[str], rows: Rows) -> Source:
    _check_columns(path, columns)
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
        text_id = str(item_id)
        safe = safe_text(text_id)
        invalid = "" if safe == text_id else f"manifest {path}, row {number}: the id {INVALID_NAME}"
        items.append(SourceItem(id=safe, path=str(resolved), extra=extra, invalid=invalid))
    if not items:
        raise SourceError(f"manifest {path} has no rows")
    counts = Counter(item.id for item in items)
    duplicates = [i for i, n in counts.items() if n > 1]
    if duplicates:
        shown = ", ".join(repr(d) for d in duplicates[:5]) + (" …" if len(duplicates) > 5 else "")
        raise SourceError(
            f"manifest {path} has {len(duplicates)} duplicate id(s): {shown}; ids must be unique "
            "(they are the catalog's keys, and a resumed job skips ids already done)"
        )
    return Source(location=str(path), kind=kind, items=items, extra_columns=extra_columns)
