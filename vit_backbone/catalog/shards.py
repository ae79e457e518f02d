"""The catalog's on-disk layout: numbered Parquet shards, written atomically, read back as one catalog.

``DIR/part-00000.parquet`` … hold ``id`` (string), ``embedding`` (``fixed_size_list<float32|float16>[D]``)
and any extra manifest columns (strings); each shard carries the ``CatalogMeta`` JSON in its key-value
metadata. A shard is written to ``*.parquet.tmp``, fsynced and linked to its final name, so a crash leaves
either the whole shard or none of it: the ids in committed shards are exactly the rows that are done, which is
what a resumed job skips.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.meta import META_KEY, CatalogMeta
from vit_backbone.errors import MissingExtraError

SHARD_PATTERN = re.compile(r"^part-(\d{5,})\.parquet$")
TMP_SUFFIX = ".tmp"
RESERVED_COLUMNS = ("id", "embedding")


@dataclass(frozen=True)
class Catalog:
    meta: CatalogMeta
    ids: list[str]
    embeddings: np.ndarray  # [N, D] float32 (float16 shards are widened)
    extra: dict[str, list[str]]  # extra manifest columns, row-aligned with ids


def _pa() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet  # registers pa.parquet
    except ImportError as exc:
        raise MissingExtraError("reading and writing catalogs", "catalog") from exc
    return pa


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def shard_paths(folder: Path) -> list[Path]:
    """Committed shards in index order (temporary files of an interrupted write are not shards)."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SHARD_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def next_shard_index(folder: Path) -> int:
    paths = shard_paths(folder)
    return 0 if not paths else int(SHARD_PATTERN.match(paths[-1].name).group(1)) + 1  # type: ignore[union-attr]


def remove_partial_shards(folder: Path) -> list[Path]:
    """Delete the ``*.parquet.tmp`` left by a write that a crash interrupted; returns what was removed."""
    removed = [p for p in folder.glob(f"part-*.parquet{TMP_SUFFIX}") if p.is_file()]
    for path in removed:
        path.unlink()
    return removed


def embedding_type(dtype: str, dim: int) -> Any:
    pa = _pa()
    return pa.list_(pa.float32() if dtype == "float32" else pa.float16(), dim)


def build_table(
    ids: Sequence[str], embeddings: np.ndarray, extra: Mapping[str, Sequence[str]], meta: CatalogMeta
) -> Any:
    """One shard's rows as a pyarrow table: a portable FixedSizeList column, the meta in the schema."""
    pa = _pa()
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32 if meta.dtype == "float32" else np.float16)
    if vectors.ndim != 2 or vectors.shape != (len(ids), meta.dim):
        raise CatalogError(f"expected embeddings [{len(ids)}, {meta.dim}], got {list(vectors.shape)}")
    clash = [name for name in extra if name in RESERVED_COLUMNS]
    if clash:
        raise CatalogError(f"extra columns may not be named {clash}")
    flat = pa.array(vectors.reshape(-1))  # [N * D]
    columns = {
        "id": pa.array(list(ids), type=pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(flat, meta.dim),
    }
    for name, values in extra.items():
        if len(values) != len(ids):
            raise CatalogError(f"extra column {name!r} has {len(values)} values for {len(ids)} ids")
        columns[name] = pa.array(list(values), type=pa.string())
    table = pa.table(columns)
    return table.replace_schema_metadata({META_KEY: meta.to_json().encode()})


def write_shard(folder: Path, index: int, table: Any) -> Path:
    """Write ``part-{index}.parquet`` atomically: temp file, fsync, hard-link to the final name, fsync the
    folder. ``os.link`` fails if the name exists, so a committed shard is never overwritten, even by a
    writer that raced past the catalog's lock."""
    pa = _pa()
    final = folder / shard_name(index)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    with tmp.open("wb") as sink:
        pa.parquet.write_table(table, sink, compression="zstd")
        sink.flush()
        os.fsync(sink.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError:
        tmp.unlink()
        raise CatalogError(f"{final} already exists; refusing to overwrite a committed shard") from None
    except OSError:  # a file system without hard links: the job's lock keeps the check-then-rename safe
        if final.exists():
            tmp.unlink()
            raise CatalogError(f"{final} already exists; refusing to overwrite a committed shard") from None
        os.replace(tmp, final)
    else:
        tmp.unlink()
    fsync_dir(folder)
    return final


def fsync_dir(folder: Path) -> None:
    """Make a rename durable (a directory fsync is a no-op where the OS does not support it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_shard_meta(path: Path) -> CatalogMeta:
    pa = _pa()
    try:
        schema = pa.parquet.read_schema(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise CatalogError(f"{path} is not a readable Parquet shard: {exc}") from exc
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise CatalogError(f"{path} has no vitembed metadata: it was not written by `vitembed embed-catalog`")
    return CatalogMeta.from_json(raw)


def committed_ids(folder: Path) -> list[str]:
    """Ids of every committed shard, in shard order (what a resumed job must not embed again)."""
    pa = _pa()
    ids: list[str] = []
    for path in shard_paths(folder):
        ids.extend(pa.parquet.read_table(path, columns=["id"]).column("id").to_pylist())
    return ids


def open_catalog(folder: Path) -> tuple[Path, list[Path], CatalogMeta]:
    """(folder, its shards in order, the first shard's metadata); refuses a missing or empty folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CatalogError(f"catalog folder {folder} does not exist")
    paths = shard_paths(folder)
    if not paths:
        raise CatalogError(f"{folder} holds no catalog shards (part-*.parquet); run `vitembed embed-catalog`")
    return folder, paths, read_shard_meta(paths[0])


def check_same_job(meta: CatalogMeta, first: Path, path: Path) -> None:
    """Refuses shard ``path`` when its metadata differ from ``meta`` (``first``'s): two different jobs
    written into one folder cannot be read as one catalog."""
    shard_meta = read_shard_meta(path)
    if shard_meta != meta:
        differences = meta.embed_options_mismatch(shard_meta) or [f"{meta} != {shard_meta}"]
        raise CatalogError(
            f"{path.name} was made with other options than {first.name} ({'; '.join(differences)}); "
            "a catalog folder must hold one job's shards"
        )


def read_catalog(folder: Path) -> Catalog:
    """Every committed shard of a catalog as one array; refuses a missing or empty folder and shards
    whose metadata disagree (two different jobs written into one folder)."""
    pa = _pa()
    folder, paths, meta = open_catalog(folder)
    ids: list[str] = []
    blocks: list[np.ndarray] = []
    extra: dict[str, list[str]] = {}
    for number, path in enumerate(paths):
        if number:
            check_same_job(meta, paths[0], path)
        table = pa.parquet.read_table(path)
        names = [n for n in table.column_names if n not in RESERVED_COLUMNS]
        if number == 0:
            extra = {n: [] for n in names}
        elif sorted(names) != sorted(extra):
            raise CatalogError(f"{path.name} has extra columns {names}, {paths[0].name} has {list(extra)}")
        column = table.column("embedding").combine_chunks()
        width = getattr(column.type, "list_size", None)
        if width != meta.dim:
            raise CatalogError(f"{path.name}: embedding column is {column.type}, expected {meta.dim} values")
        values = column.flatten().to_numpy(zero_copy_only=False)  # [n * D]
        blocks.append(values.astype(np.float32).reshape(-1, meta.dim))  # [n, D]
        ids.extend(table.column("id").to_pylist())
        for name in extra:
            extra[name].extend("" if v is None else str(v) for v in table.column(name).to_pylist())
    if len(set(ids)) != len(ids):
        raise CatalogError(f"{folder} holds duplicate ids across its shards; it is not one job's output")
    return Catalog(meta=meta, ids=ids, embeddings=np.concatenate(blocks), extra=extra)
