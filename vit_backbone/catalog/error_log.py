"""``errors.jsonl``: one line per image that could not be embedded, with the reason's stable code.

An error line is as final as a committed shard row: a resumed job skips the ids listed here. Lines are
appended with one ``write`` each (a killed process keeps what it wrote; the OS has it) and fsynced when a
shard is committed. A line torn by a crash mid-write is cut off on the next open rather than parsed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.shards import fsync_dir
from vit_backbone.catalog.sources import safe_text

ERRORS_FILE = "errors.jsonl"


@dataclass(frozen=True)
class ItemFailure:
    id: str
    path: str
    code: str  # ImageDecodeError / VitEmbedError code, or "read_error"
    message: str

    def to_json(self) -> str:
        """One line; text UTF-8 cannot hold (surrogates from undecodable file names) is backslash-escaped,
        so writing a record can never fail."""
        record = {"id": self.id, "path": self.path, "code": self.code, "message": self.message}
        return json.dumps({k: safe_text(v) for k, v in record.items()}, ensure_ascii=False)


def read_failures(folder: Path) -> list[ItemFailure]:
    path = folder / ERRORS_FILE
    if not path.is_file():
        return []
    failures = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            fields = [str(raw[key]) for key in ("id", "path", "code", "message")]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CatalogError(
                f"{path}:{number} is not an error record ({exc}); fix or remove that line"
            ) from exc
        failures.append(ItemFailure(*fields))
    return failures


class ErrorLog:
    """Appends failures to ``DIR/errors.jsonl``; ``ids`` are the failures already recorded (resume)."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / ERRORS_FILE
        _cut_torn_line(self.path)
        self.ids = {f.id for f in read_failures(folder)}
        self._handle: IO[str] | None = None

    def append(self, failure: ItemFailure) -> None:
        if self._handle is None:
            self._handle = self.path.open("a", encoding="utf-8")
        self._handle.write(failure.to_json() + "\n")
        self._handle.flush()
        self.ids.add(failure.id)

    def sync(self) -> None:
        if self._handle is not None:
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        if self._handle is not None:
            self.sync()
            self._handle.close()
            self._handle = None


def drop_failures(folder: Path, codes: frozenset[str] | None = None) -> list[ItemFailure]:
    """Remove the failures with one of ``codes`` (every failure when None) from errors.jsonl, so the next
    run tries those ids again (``--retry-errors``); returns what was removed.

    The file is rewritten to a temporary file, fsynced and renamed: a crash leaves the old list or the new
    one. Call it while holding the catalog's lock.
    """
    path = folder / ERRORS_FILE
    _cut_torn_line(path)
    failures = read_failures(folder)
    dropped = [f for f in failures if codes is None or f.code in codes]
    kept = [f for f in failures if not (codes is None or f.code in codes)]
    if not dropped:
        return []
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.writelines(f.to_json() + "\n" for f in kept)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
    return dropped


def _cut_torn_line(path: Path) -> None:
    """Drop a last line without its newline: the process died while writing it."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)
