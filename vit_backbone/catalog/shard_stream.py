"""A catalog read shard by shard, for ``vitembed index build|add``: memory stays at one shard's vectors
instead of the whole catalog's (``read_catalog`` concatenates everything, which a 10M-row catalog cannot).

``plan_catalog`` first reads only the ids and metadata of every shard (cheap: no vectors), so that a catalog
the index would refuse (shards of two jobs, duplicate ids, mismatched columns) is refused before anything is
written; ``iter_shards`` then yields one shard's rows at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shards import check_same_job, open_catalog

RESERVED_COLUMNS = ("id", "embedding")


@dataclass(frozen=True)
class CatalogPlan:
    """What a catalog holds, checked: one job's shards, unique ids, the same metadata columns."""

    folder: Path
    meta: CatalogMeta
    paths: tuple[Path, ...]
    extra_columns: tuple[str, ...]
    rows: int


@dataclass(frozen=True)
class ShardRows:
    ids: list[str]
    vectors: np.ndarray  # [n, D] float32
    extra: dict[str, list[str]]


def _pq() -> Any:
    import pyarrow.parquet as pq

    return pq


def plan_catalog(folder: Path) -> CatalogPlan:
    """Check every shard's metadata, columns and ids (a set across shards) without reading vectors."""
    pq = _pq()
    folder, paths, meta = open_catalog(folder)
    seen: set[str] = set()
    rows = 0
    columns: tuple[str, ...] = ()
    for number, path in enumerate(paths):
        if number:
            check_same_job(meta, paths[0], path)
        names = tuple(n for n in pq.read_schema(path).names if n not in RESERVED_COLUMNS)
        if number == 0:
            columns = names
        elif sorted(names) != sorted(columns):
            raise CatalogError(
                f"{path.name} has extra columns {list(names)}, {paths[0].name} has {list(columns)}"
            )
        ids = pq.read_table(path, columns=["id"]).column("id").to_pylist()
        seen.update(ids)
        rows += len(ids)
        if len(seen) != rows:
            raise CatalogError(f"{folder} holds duplicate ids across its shards; it is not one job's output")
    return CatalogPlan(folder, meta, tuple(paths), columns, rows)


def iter_shards(plan: CatalogPlan) -> Iterator[ShardRows]:
    """One shard's rows at a time, vectors widened to float32."""
    pq = _pq()
    dim = plan.meta.dim
    for path in plan.paths:
        table = pq.read_table(path)
        column = table.column("embedding").combine_chunks()
        if getattr(column.type, "list_size", None) != dim:
            raise CatalogError(f"{path.name}: embedding column is {column.type}, expected {dim} values")
        values = column.flatten().to_numpy(zero_copy_only=False)  # [n * D]
        extra = {
            name: ["" if v is None else str(v) for v in table.column(name).to_pylist()]
            for name in plan.extra_columns
        }
        yield ShardRows(
            table.column("id").to_pylist(),
            values.astype(np.float32).reshape(-1, dim),
            extra,  # [n, D]
        )
