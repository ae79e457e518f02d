"""Similar-item search: top-k of an index table for a query vector, and query images embedded exactly as the
table's vectors were.

Scores are similarities, higher is better, never LanceDB's raw distances:

- ``cosine``: the cosine of the angle, in [-1, 1] (clipped there: float32 rounding makes an image's own
  row score 1.0000001 otherwise). LanceDB's cosine distance is ``1 - cos``.
- ``dot``: the inner product. LanceDB's dot "distance" is ``1 - dot`` (measured against numpy; see the
  tests), so both convert with ``score = 1 - distance``.

With ``--normalize`` catalogs (unit vectors) and normalised queries the two are the same number. Without it,
``dot`` also rewards long vectors, which is rarely what similar-item search wants: ``cosine`` is the default.
A query *vector* is L2-normalised before searching a cosine table (no change to the ranking or scores, but no
float32 under- or overflow) and a ``normalized`` table of either metric (so a vector query scores the cosine,
like an image query embedded with the table's ``normalize``); a zero vector is refused there.

A query image is embedded with the options stored in the table (pooling, layers, size, policy,
normalisation), by a backbone whose revision and preprocessing hash equal the table's: any other model
would give vectors in another space, so a mismatch is refused with both sides named. When the table records
the compute precision its vectors were made in (``CatalogMeta.precision``), the query backbone autocasts to
it too (float16, which needs CUDA, falls back to float32 on a CPU); an older table without it is embedded in
float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vit_backbone.catalog.index_build import (
    INDEX_META_KEY,
    IndexNotFoundError,
    IndexOptions,
    IndexStoreError,
    InvalidFilterError,
    OptionsMismatchError,
    ann_partitions,
    check_where,
    extra_columns,
    filter_message,
    has_ann,
    ids_predicate,
    open_table,
    read_table_meta,
)
from vit_backbone.catalog.item_images import IMAGES_META_KEY, ImageSource
from vit_backbone.catalog.meta import META_KEY, CatalogMeta
from vit_backbone.errors import InvalidOptionError, VitEmbedError
from vit_backbone.preprocess_config import literal_size

if TYPE_CHECKING:
    from PIL import Image

    from vit_backbone.backbone import Backbone

MAX_K = 1000
MIN_NPROBES = 20  # IVF partitions visited per query on an ANN table, at least ...
NPROBE_FRACTION = 0.1  # ... and this share of the partitions (recall falls as partitions grow: see bench/)
MAX_NPROBES = 100_000
REFINE_FACTOR = 10  # ANN candidates re-ranked with the exact vectors: k * 10 (scores are then exact)
# A filtered query on an ANN table is searched exactly when the filter selects at most this many rows: IVF
# probes the partitions nearest the query, and a rare group far from it may sit in none of them.
EXACT_FILTER_ROWS = 50_000


class ModelMismatchError(OptionsMismatchError):
    code = "model_mismatch"


class InvalidVectorError(InvalidOptionError):
    code = "invalid_vector"


class IndexChangedError(IndexStoreError):
    """The table was overwritten with other contents' meaning since this handle opened it."""

    code = "index_changed"


class IndexDroppedError(IndexNotFoundError):
    """The table was dropped (or its folder moved) since this handle opened it."""

    code = "index_dropped"


@dataclass(frozen=True)
class Hit:
    id: str
    score: float  # similarity under the table's metric: higher is more similar
    metadata: dict[str, str | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "score": self.score, "metadata": dict(self.metadata)}


def check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise InvalidOptionError(f"k must be a whole number from 1 to {MAX_K}, got {k!r}")
    return k


def check_nprobes(nprobes: int | None) -> int | None:
    if nprobes is None:
        return None
    if isinstance(nprobes, bool) or not isinstance(nprobes, int) or not 1 <= nprobes <= MAX_NPROBES:
        raise InvalidOptionError(f"nprobes must be a whole number from 1 to {MAX_NPROBES}, got {nprobes!r}")
    return nprobes


def default_nprobes(indexed_rows: int) -> int:
    """Partitions probed by default: a fixed share of the index's partitions, never fewer than 20."""
    return max(MIN_NPROBES, math.ceil(ann_partitions(indexed_rows) * NPROBE_FRACTION))


def _stamp(table: Any) -> tuple[bytes | None, bytes | None]:
    metadata = table.schema.metadata or {}
    return metadata.get(META_KEY), metadata.get(INDEX_META_KEY)


class SimilarityIndex:
    """One opened table. Reads see the latest committed version (rows added or deleted by another process
    after opening are reflected); a table overwritten with other options or dropped since opening is
    refused (``IndexChangedError`` / ``IndexDroppedError``) instead of being searched with stale options."""

    def __init__(self, db: Path, name: str, table: Any, meta: CatalogMeta, options: IndexOptions) -> None:
        self.db = db
        self.name = name
        self.table = table
        self.meta = meta
        self.options = options
        self._opened_stamp = _stamp(table)

    @classmethod
    def open(cls, db: Path | str, name: str) -> SimilarityIndex:
        table = open_table(db, name)
        meta, options = read_table_meta(table, f"{name!r} in {db}")
        return cls(Path(db), name, table, meta, options)

    @property
    def metric(self) -> str:
        return self.options.metric

    @property
    def dim(self) -> int:
        return self.meta.dim

    def check_current(self) -> None:
        """The table still exists and still means what it meant at opening (its vitembed metadata is
        unchanged); one schema read, done before every search."""
        try:
            stamp = _stamp(self.table)
        except (RuntimeError, ValueError, OSError) as exc:
            raise IndexDroppedError(
                f"table {self.name!r} is no longer in {self.db} (dropped or moved since it was opened): "
                f"{' '.join(str(exc).split())[:200]}"
            ) from exc
        if stamp == self._opened_stamp:
            return
        raise IndexChangedError(
            f"table {self.name!r} in {self.db} was rebuilt with other options since it was opened "
            f"({self._differences(stamp)}); reopen it"
        )

    def _differences(self, stamp: tuple[bytes | None, bytes | None]) -> str:
        try:
            new_meta = CatalogMeta.from_json(stamp[0] or b"")
            new_options = IndexOptions.from_json(stamp[1] or b"")
        except VitEmbedError:
            return "its vitembed metadata is gone or unreadable"
        old, new = self.meta.to_dict(), new_meta.to_dict()
        changes = [f"{key}: {old[key]!r} -> {new[key]!r}" for key in old if old[key] != new.get(key)]
        if new_options != self.options:
            changes.append(f"index options: {self.options.to_json()} -> {new_options.to_json()}")
        return "; ".join(changes) or "metadata rewritten"

    def count(self, where: str | None = None) -> int:
        if where is None:
            return int(self.table.count_rows())
        try:
            return int(self.table.count_rows(check_where(where)))
        except (ValueError, RuntimeError) as exc:
            raise InvalidFilterError(filter_message(exc)) from exc

    def has_ann(self) -> bool:
        return has_ann(self.table)

    def has_id(self, item_id: str) -> bool:
        """Whether ``item_id`` is a row of the table (quoted as an SQL literal, never parsed as SQL)."""
        self.check_current()
        return self.count(ids_predicate([item_id])) > 0

    def image_source(self) -> ImageSource | None:
        """Where the catalog's image files are, as ``index build`` recorded it (None for older tables)."""
        return ImageSource.from_json((self.table.schema.metadata or {}).get(IMAGES_META_KEY))

    def indexed_rows(self) -> int:
        """Rows covered by the ANN index (0 without one)."""
        configs = [c for c in self.table.list_indices() if "vector" in list(c.columns)]
        return int(self.table.index_stats(configs[0].name).num_indexed_rows) if configs else 0

    def metadata_columns(self) -> list[str]:
        return extra_columns(self.table)

    def check_vector(self, vector: Any) -> np.ndarray:
        """A query as a finite float32 [D] array, or an error saying what the table needs. For a cosine
        table, and for a table of normalised vectors, the query is L2-normalised here (in float64): cosine
        ignores length anyway, so this only keeps float32 from under- or overflowing, and for a
        ``normalized`` table a dot-product query then scores the cosine, as image queries do. A zero (or
        subnormal) query has no direction and is refused."""
        try:
            with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, refused just below
                array = np.asarray(vector, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise InvalidVectorError(f"the query vector must be a list of {self.dim} numbers") from exc
        if array.ndim != 1 or array.shape[0] != self.dim:
            raise InvalidVectorError(
                f"the query vector has shape {list(array.shape)}; index {self.name!r} holds "
                f"{self.dim}-dimensional vectors"
            )
        if not np.isfinite(array).all():
            raise InvalidVectorError("the query vector holds non-finite values (NaN or infinity)")
        if self.metric == "cosine" or self.meta.normalized:
            wide = array.astype(np.float64)  # [D]
            norm = float(np.linalg.norm(wide))
            if norm < np.finfo(np.float32).tiny:
                raise InvalidVectorError(
                    "the query vector has zero (or subnormal) length: it has no direction to compare by "
                    f"{'cosine' if self.metric == 'cosine' else 'a normalised index'}"
                )
            array = (wide / norm).astype(np.float32)  # [D]
        return array

    def search(
        self,
        vector: Any,
        k: int = 10,
        where: str | None = None,
        *,
        exact: bool = False,
        nprobes: int | None = None,
    ) -> list[Hit]:
        """The ``k`` most similar rows (best first) among those ``where`` selects (filtered before the
        search, so k rows come back whenever k match: a filter selecting at most ``EXACT_FILTER_ROWS`` rows
        is searched exactly, and an ANN answer short of k is redone exactly). ``exact`` bypasses an ANN
        index; ``nprobes`` overrides how many IVF partitions an ANN search visits."""
        query = self.check_vector(vector)  # [D]
        probes, matching = self._route(k, where, exact, nprobes)
        if matching == 0:
            return []
        hits = self._query(query, k, where, probes)
        if probes is not None:
            available = matching if matching is not None else self.count()
            if len(hits) < min(k, available):
                hits = self._query(query, k, where, None)  # IVF missed rows that exist: exact is right
        if not all(math.isfinite(hit.score) for hit in hits):
            raise InvalidVectorError(
                "the query's scores are not finite: its values are too large for float32 inner products "
                "with this index's vectors; scale the vector down"
            )
        return hits

    def _route(
        self, k: int, where: str | None, exact: bool, nprobes: int | None
    ) -> tuple[int | None, int | None]:
        """(IVF partitions to probe, or None for an exact scan; rows ``where`` selects, when counted)."""
        check_k(k)
        check_nprobes(nprobes)
        if where is not None:
            check_where(where)
        self.check_current()
        if exact or not self.has_ann():
            return None, None
        matching: int | None = None
        if where:
            matching = self.count(where)
            if matching <= EXACT_FILTER_ROWS:
                return None, matching
        return nprobes or default_nprobes(self.indexed_rows()), matching

    def explain(
        self,
        vector: Any,
        k: int = 10,
        where: str | None = None,
        *,
        exact: bool = False,
        nprobes: int | None = None,
    ) -> str:
        """LanceDB's plan for the query ``search`` would run first (``ANNSubIndex`` in it: the IVF index
        is used; without: a flat scan)."""
        probes, _ = self._route(k, where, exact, nprobes)
        return str(self._builder(self.check_vector(vector), k, where, probes).explain_plan(verbose=True))

    def _builder(self, query: np.ndarray, k: int, where: str | None, nprobes: int | None) -> Any:
        # all columns: naming them (``select``) makes lance 0.40 log a deprecation warning on every query
        builder = self.table.search(query, vector_column_name="vector").distance_type(self.metric).limit(k)
        if where:
            builder = builder.where(where, prefilter=True)
        if nprobes is None:
            return builder.bypass_vector_index()
        return builder.nprobes(nprobes).refine_factor(REFINE_FACTOR)

    def _query(self, query: np.ndarray, k: int, where: str | None, nprobes: int | None) -> list[Hit]:
        """One LanceDB query: ANN with ``nprobes`` partitions and exact re-ranking, or exact when None."""
        try:
            result = self._builder(query, k, where, nprobes).to_arrow()
        except (ValueError, RuntimeError) as exc:
            # with a filter, lance's "Invalid input" (parsing) and "Query Execution error" (a cast or a
            # division failing on a row) are the predicate's fault; without one they are the store's
            if where and (isinstance(exc, ValueError) or "Query Execution error" in str(exc)):
                raise InvalidFilterError(filter_message(exc)) from exc
            raise IndexStoreError(
                f"searching table {self.name!r} failed: {' '.join(str(exc).split())[:300]}"
            ) from exc
        return _hits(result, clip=self.metric == "cosine" or self.meta.normalized)

    def rank_all(self, vector: Any) -> list[Hit]:
        """Every row, best first, by exact search (evaluation: mAP needs the whole ranking)."""
        query = self.check_vector(vector)  # [D]
        self.check_current()
        return self._query(query, self.count(), None, None)

    def search_many(
        self,
        vectors: Sequence[Any] | np.ndarray,
        k: int = 10,
        where: str | None = None,
        *,
        nprobes: int | None = None,
    ) -> list[list[Hit]]:
        return [self.search(v, k, where, nprobes=nprobes) for v in vectors]

    def describe(self) -> dict[str, Any]:
        self.check_current()
        return {
            "db": str(self.db),
            "table": self.name,
            "rows": self.count(),
            "metric": self.metric,
            "ann": self.has_ann(),
            "ann_threshold": self.options.ann_threshold,
            "metadata_columns": self.metadata_columns(),
            "meta": self.meta.to_dict(),
        }


def _hits(result: Any, *, clip: bool) -> list[Hit]:
    """LanceDB's result rows as hits; ``score = 1 - _distance`` for both cosine and dot (module docstring),
    clipped to [-1, 1] where it is a cosine (a cosine table, or unit vectors and unit queries)."""
    columns = [c for c in result.column_names if c not in ("id", "vector", "_distance")]
    ids = result.column("id").to_pylist()
    scores = 1.0 - result.column("_distance").to_numpy().astype(np.float64)  # [n]
    if clip:
        scores = np.clip(scores, -1.0, 1.0)  # [n]
    extra = {c: result.column(c).to_pylist() for c in columns}
    return [Hit(ids[i], float(scores[i]), {c: extra[c][i] for c in columns}) for i in range(len(ids))]


# ------------------------------------------------------------------------------------------- queries
def embed_options(meta: CatalogMeta) -> dict[str, Any]:
    """The table's embedding options as ``Backbone.embed`` keyword arguments."""
    return {
        "pooling": meta.pooling,
        "layers": None if meta.layers is None else list(meta.layers),
        "size": literal_size(meta.size),  # null: the native box, whatever the current preset's
        "policy": meta.policy,
        "normalize": meta.normalized,
    }


def check_model(meta: CatalogMeta, revision: str, preprocess_hash: str, model: str) -> None:
    """Refuse a backbone that would embed queries into another space than the table's."""
    differences = []
    if revision != meta.revision:
        differences.append(f"revision {revision} (the table needs {meta.revision})")
    if preprocess_hash != meta.preprocess_hash:
        differences.append(f"preprocess hash {preprocess_hash} (the table needs {meta.preprocess_hash})")
    if differences:
        raise ModelMismatchError(
            f"model {model!r} has {' and '.join(differences)}: the table was embedded with model "
            f"{meta.model!r}; give that checkpoint with --model"
        )


def load_query_backbone(
    meta: CatalogMeta, model: str | None = None, *, cache_dir: Path | None = None
) -> Backbone:
    """The backbone that embeds queries for this table: ``model`` if given, else where the catalog job loaded
    it from (``model_location``), else the table's model name when it can be loaded by name (``embedded``);
    checked against the table's revision and preprocessing."""
    from vit_backbone.loading import load_backbone

    target = model or meta.model_location or (meta.model if meta.model == "embedded" else None)
    if target is None:
        raise ModelMismatchError(
            f"the table was embedded with model {meta.model!r} (revision {meta.revision}), which cannot be "
            "loaded by that name: give its checkpoint folder or hub id with --model"
        )
    if model is None and meta.model_location and not _loadable(meta.model_location):
        raise ModelMismatchError(
            f"the table was embedded with model {meta.model!r} from {meta.model_location}, which is not "
            "there any more: give its checkpoint folder or hub id with --model"
        )
    from vit_backbone.checkpoint import checkpoint_facts

    revision, preprocess_hash = checkpoint_facts(target, cache_dir)
    check_model(meta, revision, preprocess_hash, target)  # before paying for the weights
    backbone = load_backbone(target, cache_dir=cache_dir)
    check_model(meta, *backbone.facts, target)
    apply_table_precision(backbone, meta)
    return backbone


def _loadable(location: str) -> bool:
    """Whether a recorded location can still be resolved: a folder that exists, or not a folder at all (a hub
    id or ``embedded``, resolved by the loader)."""
    return not location.startswith("/") or Path(location).is_dir()


def apply_table_precision(backbone: Backbone, meta: CatalogMeta) -> str:
    """Autocast the query backbone to the precision the table's vectors were made in, when recorded; returns
    the precision queries are embedded in."""
    from vit_backbone.precision import autocast_dtype

    if meta.precision is None:
        return "float32"
    try:
        backbone.autocast = autocast_dtype(meta.precision, backbone.device)
    except ValueError:  # float16 without CUDA: the closest this device offers is float32
        backbone.autocast = None
        return "float32"
    return meta.precision


def embed_queries(backbone: Backbone, meta: CatalogMeta, images: Sequence[bytes | Image.Image]) -> np.ndarray:
    """[Q, D] query vectors through the same decode → preprocess → pooled forward as the catalog job and the
    server (draft JPEG decoding included)."""
    vectors = backbone.embed(list(images), **embed_options(meta), draft=True)  # [Q, D]
    if vectors.ndim != 2 or vectors.shape[1] != meta.dim:
        raise ModelMismatchError(
            f"the model gives {list(vectors.shape[1:])}-shaped vectors with the table's options; "
            f"the table holds {meta.dim}-dimensional ones"
        )
    return vectors
