"""The similarity index: a catalog's vectors in a LanceDB table on disk, with the facts that give them
meaning.

A table holds ``id`` (string, unique), ``vector`` (``fixed_size_list<float32>[D]``; float16 catalogs are
widened) and the catalog's extra metadata columns (strings, kept for ``where`` filters). Its Arrow schema
metadata carries the ``CatalogMeta`` (key ``b"vitembed"``, as in the Parquet shards) and the index options
(key ``b"vitembed_index"``: metric and ANN threshold). Schema metadata travels with the table through
``add``, ``delete``, ``merge_insert``, index builds, compaction and reopening, so a table can never be
separated from what its vectors mean (a side file could be).

Search is exact (a flat scan) while the table is small. Once it holds ``ann_threshold`` rows (and at least
``MIN_ANN_ROWS``, what IVF-PQ needs to train its 256-entry codebooks) an IVF-PQ index with the table's own
distance type is built; later additions are folded into it by ``optimize``. This module is the pure
library; the command line is ``catalog.index_cli``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vit_backbone.catalog.index_defaults import DEFAULT_ANN_THRESHOLD
from vit_backbone.catalog.item_images import IMAGES_META_KEY, catalog_image_source
from vit_backbone.catalog.meta import META_KEY, CatalogMeta
from vit_backbone.catalog.shard_stream import iter_shards, plan_catalog
from vit_backbone.errors import InvalidOptionError, MissingExtraError, VitEmbedError
from vit_backbone.pooling import nonfinite_rows

Metric = Literal["cosine", "dot"]
METRICS: tuple[str, ...] = ("cosine", "dot")
INDEX_META_KEY = b"vitembed_index"
INDEX_FORMAT_VERSION = 1
MIN_ANN_ROWS = 256  # IVF-PQ trains 256 centroids per sub-vector: with fewer rows lance builds an empty index
RESERVED = ("id", "vector")
_DELETE_CHUNK = 500  # ids per ``id IN (...)`` predicate


class IndexStoreError(VitEmbedError):
    """The LanceDB database or table cannot be used as asked (missing, exists already, not ours)."""

    code = "index_error"


class IndexNotFoundError(IndexStoreError):
    code = "index_not_found"


class OptionsMismatchError(InvalidOptionError):
    """Vectors made with other embedding options than the table's: they would not be comparable."""

    code = "options_mismatch"


class InvalidFilterError(InvalidOptionError):
    """A ``where`` predicate that LanceDB cannot parse, that names an unknown column, or that fails while it
    runs (a cast of a non-number, a division by zero)."""

    code = "invalid_filter"


@dataclass(frozen=True)
class IndexOptions:
    """How a table is searched; fixed when it is built."""

    metric: Metric = "cosine"
    ann_threshold: int = DEFAULT_ANN_THRESHOLD
    format_version: int = INDEX_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise InvalidOptionError(f"unknown metric {self.metric!r}; choose one of {', '.join(METRICS)}")
        if isinstance(self.ann_threshold, bool) or not isinstance(self.ann_threshold, int):
            raise InvalidOptionError(f"ann_threshold must be a whole number, got {self.ann_threshold!r}")
        if self.ann_threshold < 1:
            raise InvalidOptionError(f"ann_threshold must be at least 1 row, got {self.ann_threshold}")

    def to_json(self) -> str:
        return json.dumps(
            {
                "metric": self.metric,
                "ann_threshold": self.ann_threshold,
                "format_version": self.format_version,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> IndexOptions:
        try:
            raw = json.loads(text)
            version, metric, threshold = raw.get("format_version"), raw["metric"], int(raw["ann_threshold"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IndexStoreError(f"the table's vitembed index metadata is unreadable ({exc!r})") from exc
        if version != INDEX_FORMAT_VERSION:
            raise IndexStoreError(
                f"index format_version {version!r} is not supported by this vitembed "
                f"(it reads version {INDEX_FORMAT_VERSION}); rebuild the table with `vitembed index build`"
            )
        return cls(metric=metric, ann_threshold=threshold)


@dataclass(frozen=True)
class IndexReport:
    """What an index command did, and the table's state afterwards."""

    db: str
    table: str
    rows: int  # rows in the table afterwards
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    ann: bool = False  # the table has an ANN (IVF-PQ) index
    ann_built: bool = False  # ... built by this command


# ------------------------------------------------------------------------------------------- lancedb access
def lancedb_module() -> Any:
    try:
        import lancedb
    except ImportError as exc:
        raise MissingExtraError("similarity search (LanceDB)", "catalog") from exc
    return lancedb


def _pa() -> Any:
    try:
        import pyarrow as pa
    except ImportError as exc:
        raise MissingExtraError("similarity search (LanceDB)", "catalog") from exc
    return pa


def connect(db: Path | str, *, fresh_reads: bool = True) -> Any:
    """A LanceDB connection. ``fresh_reads`` checks for a newer table version on every read, so a long-lived
    handle (the server's) sees rows that ``vitembed index add`` wrote after it opened the table."""
    lancedb = lancedb_module()
    interval = timedelta(0) if fresh_reads else None
    return lancedb.connect(str(db), read_consistency_interval=interval)


def table_names(conn: Any) -> list[str]:
    listed = conn.list_tables()
    names = getattr(listed, "tables", listed)
    return [str(n) for n in names]


def open_table(db: Path | str, name: str) -> Any:
    """The table ``name`` of the database folder ``db``; a clear error when either is missing."""
    if not Path(db).is_dir():
        raise IndexNotFoundError(
            f"LanceDB database {db} does not exist; create it with `vitembed index build`"
        )
    conn = connect(db)
    if name not in table_names(conn):
        present = ", ".join(table_names(conn)) or "none"
        raise IndexNotFoundError(f"table {name!r} is not in {db} (tables: {present})")
    return conn.open_table(name)


def read_table_meta(table: Any, where: str = "") -> tuple[CatalogMeta, IndexOptions]:
    metadata = table.schema.metadata or {}
    if META_KEY not in metadata or INDEX_META_KEY not in metadata:
        raise IndexStoreError(
            f"table {where or repr(table.name)} has no vitembed metadata: "
            "it was not built by `vitembed index build`"
        )
    return CatalogMeta.from_json(metadata[META_KEY]), IndexOptions.from_json(metadata[INDEX_META_KEY])


def has_ann(table: Any) -> bool:
    return any("vector" in list(config.columns) for config in table.list_indices())


def extra_columns(table: Any) -> list[str]:
    return [name for name in table.schema.names if name not in RESERVED]


# ------------------------------------------------------------------------------------------- rows
def arrow_rows(
    ids: Sequence[str],
    vectors: np.ndarray,
    extra: Mapping[str, Sequence[str | None]],
    meta: CatalogMeta,
    options: IndexOptions,
    images: bytes | None = None,
) -> Any:
    """The table's rows as an Arrow table, with the vitembed schema metadata (``images``: where the
    catalog's image files are, ``item_images.ImageSource`` JSON, kept so the server can show them)."""
    pa = _pa()
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [N, D]
    if vectors.ndim != 2 or vectors.shape != (len(ids), meta.dim):
        raise IndexStoreError(f"expected vectors [{len(ids)}, {meta.dim}], got {list(vectors.shape)}")
    nonfinite = nonfinite_rows(vectors)
    if len(nonfinite):
        bad = [ids[i] for i in nonfinite[:5]]
        raise IndexStoreError(f"non-finite vectors for ids {bad}: re-embed them")
    if len(set(ids)) != len(ids):
        raise IndexStoreError("the rows hold duplicate ids; an id must name one item")
    clash = [name for name in extra if name in RESERVED]
    if clash:
        raise IndexStoreError(f"metadata columns may not be named {clash}")
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("vector", pa.list_(pa.float32(), meta.dim)),
        *(pa.field(name, pa.string()) for name in extra),
    ]
    metadata = {META_KEY: meta.to_json().encode(), INDEX_META_KEY: options.to_json().encode()}
    if images:
        metadata[IMAGES_META_KEY] = images
    schema = pa.schema(fields, metadata=metadata)
    columns = [
        pa.array(list(ids), type=pa.string()),
        pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), meta.dim),  # [N * D] -> [N][D]
        *(pa.array(list(values), type=pa.string()) for values in extra.values()),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _new_table(db: Path | str, name: str, rows: Any, *, overwrite: bool) -> Any:
    Path(db).mkdir(parents=True, exist_ok=True)
    conn = connect(db)
    if name in table_names(conn) and not overwrite:
        raise IndexStoreError(
            f"table {name!r} already exists in {db}: use --overwrite to replace it, or `vitembed index add` "
            "to update it"
        )
    try:
        return conn.create_table(name, rows, mode="overwrite" if overwrite else "create")
    except ValueError as exc:  # lance's message for an invalid table name
        raise IndexStoreError(f"cannot create table {name!r} in {db}: {exc}") from exc


def create_table(
    db: Path | str,
    name: str,
    ids: Sequence[str],
    vectors: np.ndarray,
    meta: CatalogMeta,
    *,
    extra: Mapping[str, Sequence[str | None]] | None = None,
    options: IndexOptions | None = None,
    overwrite: bool = False,
) -> IndexReport:
    """A new table from arrays (``eval retrieval`` embeds them; ``index build`` streams a catalog)."""
    options = options or IndexOptions()
    if not ids:
        raise IndexStoreError("no rows to index")
    table = _new_table(db, name, arrow_rows(ids, vectors, extra or {}, meta, options), overwrite=overwrite)
    built = ensure_ann(table, options)
    return IndexReport(
        str(db), name, table.count_rows(), inserted=len(ids), ann=has_ann(table), ann_built=built
    )


def build_index(
    catalog_dir: Path,
    db: Path | str,
    name: str,
    *,
    metric: Metric = "cosine",
    ann_threshold: int = DEFAULT_ANN_THRESHOLD,
    overwrite: bool = False,
) -> IndexReport:
    """``vitembed index build``: every row of a catalog into a new table, one shard at a time (the table is
    created from the first shard and the others are appended), so memory holds one shard's vectors. The
    whole catalog is checked first (ids unique across shards, one job's metadata) from its id columns."""
    plan = plan_catalog(Path(catalog_dir))
    options = IndexOptions(metric=metric, ann_threshold=ann_threshold)
    if not plan.rows:
        raise IndexStoreError("no rows to index")
    source = catalog_image_source(Path(catalog_dir))
    images = None if source is None else source.to_json().encode()
    table: Any = None
    for shard in iter_shards(plan):
        if not shard.ids:
            continue
        rows = arrow_rows(shard.ids, shard.vectors, shard.extra, plan.meta, options, images)
        if table is None:
            table = _new_table(db, name, rows, overwrite=overwrite)
        else:
            table.add(rows)
    built = ensure_ann(table, options)
    return IndexReport(
        str(db), name, table.count_rows(), inserted=plan.rows, ann=has_ann(table), ann_built=built
    )


def add_catalog(catalog_dir: Path, db: Path | str, name: str) -> IndexReport:
    """``vitembed index add``: upsert a catalog's rows by id. Refused when the catalog's embedding options
    differ from the table's (the vectors would not be comparable) or when it brings metadata columns the
    table does not have; columns it lacks are stored as null. The whole catalog is checked first, then
    upserted shard by shard (one shard's vectors in memory)."""
    table = open_table(db, name)
    meta, options = read_table_meta(table)
    plan = plan_catalog(Path(catalog_dir))
    differences = meta.embed_options_mismatch(plan.meta)
    if differences:
        raise OptionsMismatchError(
            f"catalog {catalog_dir} was embedded with other options than table {name!r}: "
            f"{'; '.join(differences)} (table first); re-embed it with the table's options or build a new "
            "table"
        )
    columns = extra_columns(table)
    unknown = [c for c in plan.extra_columns if c not in columns]
    if unknown:
        raise IndexStoreError(
            f"catalog {catalog_dir} has metadata columns {unknown} that table {name!r} lacks "
            f"(it has {columns}); rebuild the table with `vitembed index build --overwrite`"
        )
    inserted = updated = 0
    images = (table.schema.metadata or {}).get(IMAGES_META_KEY)  # the table keeps its own catalog's source
    for shard in iter_shards(plan):
        if not shard.ids:
            continue
        missing: list[str | None] = [None] * len(shard.ids)
        extra: dict[str, Sequence[str | None]] = {c: shard.extra.get(c, missing) for c in columns}
        rows = arrow_rows(shard.ids, shard.vectors, extra, meta, options, images)
        result = (
            table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(rows)
        )
        inserted += int(result.num_inserted_rows)
        updated += int(result.num_updated_rows)
    built = ensure_ann(table, options, changed=True)
    return IndexReport(
        str(db),
        name,
        table.count_rows(),
        inserted=inserted,
        updated=updated,
        ann=has_ann(table),
        ann_built=built,
    )


def delete_rows(
    db: Path | str, name: str, *, ids: Sequence[str] = (), where: str | None = None
) -> IndexReport:
    """``vitembed index delete``: rows by id, or every row a SQL predicate selects."""
    if bool(ids) == bool(where):
        raise InvalidOptionError("give either ids or a --where predicate (one of them)")
    if where is not None:
        check_where(where)
    table = open_table(db, name)
    _, options = read_table_meta(table)
    before = table.count_rows()
    if where:
        try:
            table.delete(where)
        except (ValueError, RuntimeError) as exc:
            raise InvalidFilterError(filter_message(exc)) from exc
    for start in range(0, len(ids), _DELETE_CHUNK):
        try:
            table.delete(ids_predicate(ids[start : start + _DELETE_CHUNK]))
        except (ValueError, RuntimeError) as exc:  # our own predicate: never the user's fault
            raise IndexStoreError(f"deleting ids from table {name!r} failed: {exc}") from exc
    after = table.count_rows()
    if before != after:
        ensure_ann(table, options, changed=True)
    return IndexReport(str(db), name, after, deleted=before - after, ann=has_ann(table))


def check_where(where: str) -> str:
    """Refuse an empty predicate and one holding ``;`` outside a string literal: a filter is one SQL
    expression, never statements (lance would silently ignore what follows a ``;``)."""
    if not where.strip():
        raise InvalidFilterError("the where filter is empty")
    quoted = False
    for char in where:
        if char == "'":
            quoted = not quoted  # '' inside a literal toggles twice: still quoted
        elif char == ";" and not quoted:
            raise InvalidFilterError(
                "invalid where filter: ';' is not allowed outside a quoted string; give one SQL predicate, "
                "e.g. brand = 'acme' AND price < '10'"
            )
    return where


def ids_predicate(ids: Sequence[str]) -> str:
    quoted = ", ".join("'" + value.replace("'", "''") + "'" for value in ids)  # SQL string literals
    return f"id IN ({quoted})"


def filter_message(exc: Exception) -> str:
    """LanceDB's complaint about a predicate, cut short (it quotes the predicate back) and without the
    Rust source location that execution errors carry."""
    text = " ".join(str(exc).split()).removeprefix("Invalid input, ").removeprefix("lance error: ")
    text = text.split(", /root/")[0].split(", /home/")[0]
    text = re.sub(r", [^ ]+\.rs:\d+:\d+$", "", text)
    return f"invalid where filter: {text[:300]}"


# ------------------------------------------------------------------------------------------- ANN
def ann_partitions(rows: int) -> int:
    """IVF partitions for a table of ``rows``: about sqrt(rows), with at least 256 rows per centroid."""
    return max(1, min(rows // MIN_ANN_ROWS, round(math.sqrt(rows))))


def ensure_ann(table: Any, options: IndexOptions, *, changed: bool = False) -> bool:
    """Build the IVF-PQ index once the table reaches the threshold; fold changed rows into an existing one.
    Returns whether an index was built now."""
    if has_ann(table):
        if changed:
            table.optimize()  # compaction + adds new rows to the index (unindexed rows are scanned exactly)
        return False
    rows = table.count_rows()
    if rows < max(options.ann_threshold, MIN_ANN_ROWS):
        return False
    from lancedb.index import IvfPq

    partitions = ann_partitions(rows)
    try:
        table.create_index("vector", config=IvfPq(distance_type=options.metric, num_partitions=partitions))
    except (ValueError, RuntimeError) as exc:
        raise IndexStoreError(f"building the IVF-PQ index of {rows} rows failed: {exc}") from exc
    return True
