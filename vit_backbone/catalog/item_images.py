"""The images behind an index's rows, found by id in the catalog's own source — never by a path a client
names.

``vitembed index build`` records where the catalog's images came from (the folder or manifest that
``embed-catalog`` read, from ``catalog.json``) in the table's schema metadata (key ``b"vitembed_images"``).
``ItemImages`` turns a row id back into that file:

* folder source: the id is the POSIX path relative to the folder; the resolved file must lie inside the
  folder (``..`` and symbolic links out of it are refused), be a regular file and have an image extension;
* manifest source (CSV, JSONL, Parquet): the manifest's own ``path`` for that id, read once (and again when
  the manifest file changes).

Either way the id must be a row of the table (the caller checks) and the bytes read are capped. A table
built before this was recorded, or an id added from another catalog, has no image: ``ItemNotFoundError``.
"""

from __future__ import annotations

import io
import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from vit_backbone.catalog.sources import IMAGE_EXTENSIONS, open_source
from vit_backbone.decode import DecodeLimits, decode
from vit_backbone.errors import InvalidOptionError, VitEmbedError

IMAGES_META_KEY = b"vitembed_images"
MAX_THUMBNAIL_SIDE = 512


class ItemNotFoundError(VitEmbedError):
    """No image for this id: not a row of the index, outside the catalog's source, or not readable."""

    code = "item_not_found"


@dataclass(frozen=True)
class ImageSource:
    kind: str  # "folder" | "csv" | "jsonl" | "parquet"
    location: str  # absolute folder or manifest file

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "location": self.location}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes | None) -> ImageSource | None:
        if not text:
            return None
        try:
            raw = json.loads(text)
            return cls(kind=str(raw["kind"]), location=str(raw["location"]))
        except (ValueError, KeyError, TypeError):
            return None


def catalog_image_source(catalog_dir: Path) -> ImageSource | None:
    """Where a catalog's images came from, as its ``catalog.json`` recorded it (None when it did not)."""
    from vit_backbone.catalog.job_folder import read_job_file

    job = read_job_file(Path(catalog_dir))
    if job is None or not job.record.source or not job.record.source_kind:
        return None
    return ImageSource(kind=job.record.source_kind, location=job.record.source)


class ItemImages:
    """Row id → image file of one index's catalog (see the module docstring)."""

    def __init__(self, source: ImageSource | None, limits: DecodeLimits | None = None) -> None:
        self.source = source
        self.limits = limits or DecodeLimits()
        self._lock = threading.Lock()
        self._manifest: tuple[float, dict[str, str]] | None = None  # (mtime, id -> path)

    def _missing(self, item_id: str, why: str) -> ItemNotFoundError:
        return ItemNotFoundError(f"no image for item {item_id[:128]!r}: {why}")

    def path_for(self, item_id: str) -> Path:
        if self.source is None:
            raise self._missing(
                item_id,
                "the index does not record its catalog's source; rebuild it with `vitembed index build`",
            )
        if self.source.kind == "folder":
            root = Path(self.source.location).resolve()
            if not item_id or "\x00" in item_id or item_id.startswith("/"):
                raise self._missing(item_id, "not a path inside the catalog's folder")
            path = (root / item_id).resolve()
            if not path.is_relative_to(root):
                raise self._missing(item_id, "not a path inside the catalog's folder")
        else:
            found = self._manifest_paths().get(item_id)
            if found is None:
                raise self._missing(item_id, "not in the catalog's manifest")
            path = Path(found)
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            raise self._missing(item_id, "not an image file name")
        return path

    def _manifest_paths(self) -> dict[str, str]:
        assert self.source is not None
        location = Path(self.source.location)
        try:
            mtime = location.stat().st_mtime
        except OSError as exc:
            raise ItemNotFoundError(f"the catalog's manifest {location} cannot be read ({exc})") from exc
        with self._lock:
            if self._manifest is None or self._manifest[0] != mtime:
                paths = {item.id: item.path for item in open_source(location).items}
                self._manifest = (mtime, paths)
            return self._manifest[1]

    def read(self, item_id: str) -> bytes:
        """The item's file bytes (a regular file, at most ``limits.max_bytes``)."""
        path = self.path_for(item_id)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise self._missing(item_id, "the file cannot be opened") from exc
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise self._missing(item_id, "not a regular file")
            if info.st_size > self.limits.max_bytes:
                raise self._missing(item_id, f"the file is over {self.limits.max_bytes} bytes")
            return handle.read(self.limits.max_bytes + 1)[: self.limits.max_bytes]


def thumbnail_jpeg(data: bytes, max_side: int, limits: DecodeLimits | None = None) -> bytes:
    """A JPEG of an image whose longer side is at most ``max_side`` pixels (decoded safely, draft mode)."""
    if isinstance(max_side, bool) or not 16 <= max_side <= MAX_THUMBNAIL_SIDE:
        raise InvalidOptionError(f"max_side must be from 16 to {MAX_THUMBNAIL_SIDE}, got {max_side}")

    def at_least(source_hw: tuple[int, int]) -> tuple[int, int]:
        h, w = source_hw
        scale = max_side / max(h, w)
        return max(1, int(w * scale)), max(1, int(h * scale))

    image = decode(data, limits=limits, min_size=at_least).image
    image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=85)
    return buffer.getvalue()
