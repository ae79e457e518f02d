"""Training data for heads: labelled image folders, segmentation folders, catalog embeddings.

Conventions (documented in the README):

- **Classification folder**: one subfolder per class, images inside (``.jpg .jpeg .png .webp .bmp .gif
  .tif .tiff``); the class name is the subfolder's name, classes sorted by name. Hidden entries are skipped.
- **Segmentation folder** (``--kind patch``): every image (searched recursively) has its mask beside it,
  ``x.jpg`` + ``x.mask.png``: a single-channel PNG of the image's size whose pixel value is the class id,
  255 = ignore. Class names come from ``classes.txt`` at the folder's root (line i names class i), else
  they are ``0 .. max``. An image without a mask is an error (nothing is dropped silently).
- **Parquet embeddings**: a file, or a folder of ``*.parquet`` shards, with ``id`` (string), ``embedding``
  (fixed-size list of float32/float16) and ``label`` columns, as written by ``vitembed embed-catalog``
  plus a label; the key-value metadata ``b"vitembed"`` (model, revision, preprocess_hash, pooling, layers,
  size, policy, normalized, dim) fills the head card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..errors import InvalidOptionError, MissingExtraError, ModelNotFoundError
from .patch import IGNORE

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MASK_SUFFIX = ".mask.png"
CLASSES_FILE = "classes.txt"
PARQUET_META_KEY = b"vitembed"


def _is_image(path: Path) -> bool:
    return (
        path.is_file()
        and path.suffix.lower() in IMAGE_SUFFIXES
        and not path.name.lower().endswith(MASK_SUFFIX)
        and not path.name.startswith(".")
    )


def _folder(root: str | Path) -> Path:
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder} is not a folder")
    return folder


@dataclass(frozen=True)
class LabelledImages:
    paths: tuple[Path, ...]
    labels: tuple[int, ...]  # index into classes
    classes: tuple[str, ...]


def read_labelled_folder(root: str | Path) -> LabelledImages:
    """One subfolder per class; at least two classes, each with at least one image."""
    folder = _folder(root)
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(subfolders) < 2:
        raise InvalidOptionError(
            f"{folder} needs one subfolder per class (at least 2), found {len(subfolders)}; "
            "for a segmentation task use --kind patch with masks beside the images"
        )
    paths: list[Path] = []
    labels: list[int] = []
    for label, sub in enumerate(subfolders):
        files = sorted(p for p in sub.rglob("*") if _is_image(p))
        if not files:
            raise InvalidOptionError(f"class folder {sub} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        paths += files
        labels += [label] * len(files)
    return LabelledImages(tuple(paths), tuple(labels), tuple(p.name for p in subfolders))


@dataclass(frozen=True)
class SegmentationImages:
    images: tuple[Path, ...]
    masks: tuple[Path, ...]
    classes: tuple[str, ...]


def mask_path(image: Path) -> Path:
    return image.with_name(image.stem + MASK_SUFFIX)


def read_mask(path: Path) -> np.ndarray:
    """[H, W] int64 class ids from a single-channel PNG (L, P, I;16 or I)."""
    with Image.open(path) as img:
        if img.mode not in ("L", "P", "I;16", "I"):
            raise InvalidOptionError(
                f"mask {path} has mode {img.mode}: masks are single-channel PNGs whose pixel value is the "
                f"class id ({IGNORE} = ignore)"
            )
        return np.asarray(img, dtype=np.int64)


def read_segmentation_folder(root: str | Path) -> SegmentationImages:
    folder = _folder(root)
    images = sorted(p for p in folder.rglob("*") if _is_image(p))
    if not images:
        raise InvalidOptionError(f"{folder} holds no images")
    unmasked = [p for p in images if not mask_path(p).is_file()]
    if unmasked:
        shown = ", ".join(str(p.relative_to(folder)) for p in unmasked[:3])
        raise InvalidOptionError(
            f"{len(unmasked)} image(s) have no mask beside them (e.g. {shown}); "
            f"each x.jpg needs x{MASK_SUFFIX}"
        )
    masks = [mask_path(p) for p in images]
    names_file = folder / CLASSES_FILE
    if names_file.is_file():
        classes = tuple(line.strip() for line in names_file.read_text().splitlines() if line.strip())
    else:
        top = max(int(v) for m in masks for v in np.unique(read_mask(m)) if v != IGNORE)
        classes = tuple(str(i) for i in range(max(top, 1) + 1))
    return SegmentationImages(tuple(images), tuple(masks), classes)


# ------------------------------------------------------------------------------------------- Parquet
@dataclass(frozen=True)
class EmbeddingTable:
    """Labelled vectors from catalog Parquet, with the facts of the features that made them."""

    ids: tuple[str, ...]
    features: np.ndarray  # [N, F] float32
    labels: tuple[int, ...]  # index into classes
    classes: tuple[str, ...]
    meta: dict[str, Any]  # the catalog's b"vitembed" metadata


_REQUIRED_META = ("model", "revision", "preprocess_hash", "pooling", "layers", "normalized", "dim")


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.parquet") if p.is_file())
        if not files:
            raise InvalidOptionError(f"{path} holds no *.parquet files")
        return files
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist")
    return [path]


def read_embedding_parquet(path: str | Path) -> EmbeddingTable:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtraError("training heads from Parquet embeddings", "catalog") from exc
    files = _parquet_files(Path(path).expanduser())
    meta: dict[str, Any] | None = None
    ids: list[str] = []
    vectors: list[np.ndarray] = []
    raw_labels: list[Any] = []
    for file in files:
        try:
            table = pq.read_table(file, columns=["id", "embedding", "label"])
        except (OSError, pa.ArrowInvalid, KeyError) as exc:
            raise InvalidOptionError(
                f"{file}: cannot read columns id, embedding, label ({str(exc).splitlines()[0]})"
            ) from exc
        these = _file_meta(file, table.schema.metadata)
        if meta is not None and these != meta:
            raise InvalidOptionError(f"{file} was written with other features than {files[0]}")
        meta = these
        labels = table.column("label").to_pylist()
        missing = [i for i, v in enumerate(labels) if v is None]
        if missing:
            row_id = table.column("id")[missing[0]].as_py()
            raise InvalidOptionError(f"{file}: {len(missing)} row(s) have no label (e.g. id {row_id!r})")
        ids += [str(v) for v in table.column("id").to_pylist()]
        vectors.append(_vectors(table.column("embedding"), int(these["dim"]), file))
        raw_labels += labels
    if meta is None or not ids:
        raise InvalidOptionError(f"{path} holds no rows")
    classes = tuple(sorted({str(v) for v in raw_labels}))
    if len(classes) < 2:
        raise InvalidOptionError(f"{path}: a head needs at least 2 labels, found {list(classes)}")
    index = {name: i for i, name in enumerate(classes)}
    return EmbeddingTable(
        ids=tuple(ids),
        features=np.concatenate(vectors),
        labels=tuple(index[str(v)] for v in raw_labels),
        classes=classes,
        meta=meta,
    )


def _file_meta(file: Path, metadata: dict[bytes, bytes] | None) -> dict[str, Any]:
    raw = (metadata or {}).get(PARQUET_META_KEY)
    if raw is None:
        raise InvalidOptionError(
            f"{file} has no vitembed metadata (key {PARQUET_META_KEY!r}): the head card could not say which "
            "backbone made these vectors; write them with `vitembed embed-catalog`"
        )
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidOptionError(f"{file}: the vitembed metadata is not valid JSON") from exc
    missing = (
        [key for key in _REQUIRED_META if key not in meta] if isinstance(meta, dict) else list(_REQUIRED_META)
    )
    if missing:
        raise InvalidOptionError(f"{file}: the vitembed metadata lacks {', '.join(missing)}")
    return dict(meta)


def _vectors(column: Any, dim: int, file: Path) -> np.ndarray:
    import pyarrow as pa

    array = column.combine_chunks()
    if not pa.types.is_fixed_size_list(array.type) and not pa.types.is_list(array.type):
        raise InvalidOptionError(f"{file}: the embedding column must be a list of floats, got {array.type}")
    if array.null_count:
        raise InvalidOptionError(f"{file}: {array.null_count} row(s) have no embedding")
    flat = array.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    if flat.size != len(array) * dim:
        raise InvalidOptionError(f"{file}: embeddings are not all {dim}-dimensional as the metadata says")
    return flat.reshape(len(array), dim)  # [n, F]
