"""Similar-item search: top-k of an index table for a query vector, and query images embedded exactly as the
table's vectors were.

Scores are similarities, higher is better, never LanceDB's raw distances:

- ``cosine``: the cosine of the angle, in [-1, 1]. LanceDB's cosine distance is ``1 - cos``.
- ``dot``: the inner product. LanceDB's dot "distance" is ``1 - dot`` (measured against numpy; see the
  tests), so both convert with ``score = 1 - distance``.

With ``--normalize`` catalogs (unit vectors) and normalised queries the two are the same number. Without it,
``dot`` also rewards long vectors, which is rarely what similar-item search wants: ``cosine`` is the default.

A query image is embedded with the options stored in the table (pooling, layers, size, policy,
normalisation), by a backbone whose revision and preprocessing hash equal the table's: any other model
would give vectors in another space, so a mismatch is refused with both sides named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vit_backbone.errors import InvalidOptionError

from .index import (
    IndexOptions,
    InvalidFilterError,
    OptionsMismatchError,
    extra_columns,
    filter_message,
    has_ann,
    open_table,
    read_table_meta,
)
from .meta import CatalogMeta

if TYPE_CHECKING:
    from PIL import Image

    from vit_backbone.backbone import Backbone

MAX_K = 1000
NPROBES = 20  # IVF partitions visited per query on an ANN table
REFINE_FACTOR = 10  # ANN candidates re-ranked with the exact vectors: k * 10 (scores are then exact)


class ModelMismatchError(OptionsMismatchError):
    code = "model_mismatch"


class InvalidVectorError(InvalidOptionError):
    code = "invalid_vector"


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


class SimilarityIndex:
    """One opened table. Reads see the latest committed version (rows added or deleted by another process
    after opening are reflected)."""

    def __init__(self, db: Path, name: str, table: Any, meta: CatalogMeta, options: IndexOptions) -> None:
        self.db = db
        self.name = name
        self.table = table
        self.meta = meta
        self.options = options

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

    def count(self) -> int:
        return int(self.table.count_rows())

    def has_ann(self) -> bool:
        return has_ann(self.table)

    def metadata_columns(self) -> list[str]:
        return extra_columns(self.table)

    def check_vector(self, vector: Any) -> np.ndarray:
        """A query as a finite float32 [D] array, or an error saying what the table needs."""
        try:
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
        return array

    def search(self, vector: Any, k: int = 10, where: str | None = None, *, exact: bool = False) -> list[Hit]:
        """The ``k`` most similar rows (best first) among those ``where`` selects (filtered before the
        search, so k rows come back whenever k match). ``exact`` bypasses an ANN index."""
        query = self.check_vector(vector)  # [D]
        check_k(k)
        if where is not None and not where.strip():
            raise InvalidFilterError("the where filter is empty")
        # all columns: naming them (``select``) makes lance 0.40 log a deprecation warning on every query
        builder = self.table.search(query, vector_column_name="vector").distance_type(self.metric).limit(k)
        if where:
            builder = builder.where(where, prefilter=True)
        if exact:
            builder = builder.bypass_vector_index()
        elif self.has_ann():
            builder = builder.nprobes(NPROBES).refine_factor(REFINE_FACTOR)
        try:
            result = builder.to_arrow()
        except ValueError as exc:  # lance: "Invalid input, ..." for a bad predicate
            raise InvalidFilterError(filter_message(exc)) from exc
        return _hits(result)

    def rank_all(self, vector: Any) -> list[Hit]:
        """Every row, best first, by exact search (evaluation: mAP needs the whole ranking)."""
        query = self.check_vector(vector)  # [D]
        builder = self.table.search(query, vector_column_name="vector").distance_type(self.metric)
        return _hits(builder.limit(self.count()).bypass_vector_index().to_arrow())

    def search_many(
        self, vectors: Sequence[Any] | np.ndarray, k: int = 10, where: str | None = None
    ) -> list[list[Hit]]:
        return [self.search(v, k, where) for v in vectors]

    def describe(self) -> dict[str, Any]:
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


def _hits(result: Any) -> list[Hit]:
    """LanceDB's result rows as hits; ``score = 1 - _distance`` for both cosine and dot (module docstring)."""
    columns = [c for c in result.column_names if c not in ("id", "vector", "_distance")]
    ids = result.column("id").to_pylist()
    distances = result.column("_distance").to_numpy()  # [n]
    extra = {c: result.column(c).to_pylist() for c in columns}
    return [
        Hit(ids[i], 1.0 - float(distances[i]), {c: extra[c][i] for c in columns}) for i in range(len(ids))
    ]


# ------------------------------------------------------------------------------------------- queries
def embed_options(meta: CatalogMeta) -> dict[str, Any]:
    """The table's embedding options as ``Backbone.embed`` keyword arguments."""
    return {
        "pooling": meta.pooling,
        "layers": None if meta.layers is None else list(meta.layers),
        "size": None if meta.size is None else (meta.size[0], meta.size[1]),
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


def checkpoint_fingerprint(target: str, cache_dir: Path | None = None) -> tuple[str, str]:
    """(revision, preprocessing hash) of a model reference, read from its files without loading weights."""
    from vit_backbone.loading import load_spec, read_processor_config, resolve_checkpoint
    from vit_backbone.preprocess import PreprocessConfig

    checkpoint = resolve_checkpoint(target, cache_dir=cache_dir)
    spec, _ = load_spec(checkpoint.path)
    processor = read_processor_config(checkpoint.path) or dict(spec.default_processor)
    return checkpoint.revision, PreprocessConfig.from_processor_dict(processor).hash()


def load_query_backbone(
    meta: CatalogMeta, model: str | None = None, *, cache_dir: Path | None = None
) -> Backbone:
    """The backbone that embeds queries for this table: ``model`` if given, else the table's own model name
    when that can be loaded by name (``embedded``); checked against the table's revision and preprocessing."""
    from vit_backbone import load_backbone

    target = model or (meta.model if meta.model == "embedded" else None)
    if target is None:
        raise ModelMismatchError(
            f"the table was embedded with model {meta.model!r} (revision {meta.revision}), which cannot be "
            "loaded by that name: give its checkpoint folder or hub id with --model"
        )
    revision, preprocess_hash = checkpoint_fingerprint(target, cache_dir)
    check_model(meta, revision, preprocess_hash, target)  # before paying for the weights
    backbone = load_backbone(target, cache_dir=cache_dir)
    check_model(meta, backbone.checkpoint.revision, backbone.preprocess_config.hash(), target)
    return backbone


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
