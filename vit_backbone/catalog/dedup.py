"""Near-duplicate groups in an embedded catalog: connected components of the pairs whose cosine similarity
is at least a threshold.

The N x N similarity matrix is never held: rows are compared block by block (``block`` x N products of
L2-normalised float32 vectors), keeping only the above-threshold pairs, so memory is the vectors plus one
block of scores (100k x 384 float32: 154 MB of vectors, 4096 x 100k scores = 1.6 GB at the default block).
Each group's representative is the member closest to the group's mean direction; every member reports its
cosine to it. The default threshold is calibrated on bench/copy_detection.py's copy set (README "Near
duplicates"); it is a cosine of the catalog's own features, so a catalog made with other options (model,
pooling, block) should be given its own threshold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shard_stream import iter_shards, plan_catalog
from vit_backbone.presets import DEFAULT_PRESET

# The embedded default features' threshold, per preset. default-v3 (cls_mean_hflip of block 8, trim_squash,
# 98x98): on two views of each of 4 real photos with 5 copies each (tests/vit_backbone/catalog/test_dedup.py)
# other views of the same photo score <= 0.897 and every copy but one >= 0.944 with its original (a
# screenshot-style copy 0.895): 0.90-0.94 gives pairwise precision 1.0, recall 0.958; on the copy set
# (bench/copy_detection.py) 0.92 keeps 0.953 of the query-original pairs. default-v2 (mean of block 8,
# trim_squash, 224): copies >= 0.938, other views <= 0.897, 0.90-0.92 gives 1.0 / 1.0; the copy set keeps
# 0.872 at 0.92. README "Near duplicates".
DEFAULT_THRESHOLD = 0.92
PRESET_THRESHOLDS: dict[str, float] = {"default-v2": 0.92, "default-v3": 0.92}
DEFAULT_BLOCK = 4096


@dataclass(frozen=True)
class DuplicateGroups:
    group: np.ndarray  # [M] int64: group number, 0.. in order of each group's first member
    index: np.ndarray  # [M] int64: row of the member in the catalog
    similarity: np.ndarray  # [M] float32: cosine to the group's representative (1 for the representative)
    representative: np.ndarray  # [G] int64: catalog row of each group's representative
    pairs: int  # above-threshold pairs found
    threshold: float


def default_threshold(meta: CatalogMeta | None) -> tuple[float, str]:
    """The calibrated threshold for a catalog's features and where it comes from: the threshold of the
    preset that made them when the catalog holds exactly that preset's embedded-backbone features, else
    the current default's (``uncalibrated``: a cosine of other features means something else)."""
    from vit_backbone.presets import PRESETS

    if meta is not None and meta.preset in PRESET_THRESHOLDS:
        p = PRESETS[meta.preset]
        same = (
            meta.model == "embedded"
            and meta.pooling == p.pooling
            and meta.layers == list(p.layers)
            and meta.policy == p.policy
            and meta.size == (None if p.size is None else list(p.size))
        )
        if same:
            return PRESET_THRESHOLDS[meta.preset], f"calibrated for {meta.preset}"
    return DEFAULT_THRESHOLD, f"uncalibrated for these features: {DEFAULT_PRESET}'s"


def catalog_meta(folder: Path) -> CatalogMeta:
    return plan_catalog(folder).meta


def load_catalog_vectors(folder: Path) -> tuple[list[str], np.ndarray]:
    """Every id and vector of a catalog folder (``vitembed embed-catalog`` output), shard by shard."""
    plan = plan_catalog(folder)
    ids: list[str] = []
    parts: list[np.ndarray] = []
    for shard in iter_shards(plan):
        ids.extend(shard.ids)
        parts.append(shard.vectors)  # [n, D]
    if not ids:
        raise CatalogError(f"{folder}: the catalog holds no rows")
    return ids, np.concatenate(parts)  # [N, D]


def load_table_vectors(db: Path, table: str, *, batch_rows: int = 65_536) -> tuple[list[str], np.ndarray]:
    """Every id and vector of a LanceDB table written by ``vitembed index build``, read in record batches."""
    from vit_backbone.catalog.index_build import open_table

    handle = open_table(db, table)
    ids: list[str] = []
    parts: list[np.ndarray] = []
    for batch in handle.search().select(["id", "vector"]).limit(None).to_batches(batch_rows):
        ids.extend(batch.column("id").to_pylist())
        flat = batch.column("vector").flatten().to_numpy(zero_copy_only=False)  # [n * D]
        parts.append(np.asarray(flat, dtype=np.float32).reshape(batch.num_rows, -1))  # [n, D]
    if not ids:
        raise CatalogError(f"{db}:{table}: the table holds no rows")
    return ids, np.concatenate(parts)  # [N, D]


def table_meta(db: Path, table: str) -> CatalogMeta:
    from vit_backbone.catalog.index_build import open_table, read_table_meta

    return read_table_meta(open_table(db, table))[0]


def above_threshold_pairs(
    vectors: np.ndarray, threshold: float, *, block: int = DEFAULT_BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, j, cosine) of every pair i < j with cosine >= threshold, from block x N products."""
    if not -1.0 <= threshold <= 1.0:
        raise CatalogError(f"threshold is a cosine similarity in [-1, 1], got {threshold}")
    if block < 1:
        raise CatalogError("block must be at least 1")
    x = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # [N, 1]
    if not np.all(norms > 0) or not np.isfinite(x).all():
        raise CatalogError("the catalog holds zero or non-finite vectors: cosine similarity is undefined")
    x = x / norms  # [N, D]
    found_i, found_j, found_s = [], [], []
    for start in range(0, len(x), block):
        scores = x[start : start + block] @ x[start:].T  # [b, N - start]: only pairs j >= i
        rows, cols = np.nonzero(scores >= threshold)
        keep = cols > rows  # drop the diagonal and the lower triangle of the first square
        rows, cols = rows[keep], cols[keep]
        found_i.append(rows + start)
        found_j.append(cols + start)
        found_s.append(scores[rows, cols])
    return np.concatenate(found_i), np.concatenate(found_j), np.concatenate(found_s).astype(np.float32)


def find_duplicates(
    vectors: np.ndarray, threshold: float = DEFAULT_THRESHOLD, *, block: int = DEFAULT_BLOCK
) -> DuplicateGroups:
    """Groups of two or more rows joined by above-threshold pairs (connected components)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(vectors)
    i, j, _ = above_threshold_pairs(vectors, threshold, block=block)
    graph = coo_matrix((np.ones(len(i), dtype=np.int8), (i, j)), shape=(n, n))
    _, labels = connected_components(graph, directed=False)  # [N]
    sizes = np.bincount(labels)
    members = np.nonzero(sizes[labels] > 1)[0]  # rows in a group of 2+, catalog order
    x = np.asarray(vectors, dtype=np.float32)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    order = {label: g for g, label in enumerate(dict.fromkeys(labels[members].tolist()))}
    group = np.asarray([order[label] for label in labels[members]], dtype=np.int64)  # [M]
    similarity = np.zeros(len(members), dtype=np.float32)
    representative = np.zeros(len(order), dtype=np.int64)
    for g in range(len(order)):
        rows = members[group == g]
        centre = x[rows].mean(axis=0)  # [D]
        rep = rows[int(np.argmax(x[rows] @ centre))]
        representative[g] = rep
        similarity[group == g] = x[rows] @ x[rep]
    return DuplicateGroups(group, members.astype(np.int64), similarity, representative, len(i), threshold)


def write_duplicates(
    found: DuplicateGroups,
    ids: Sequence[str],
    out: Path,
    *,
    source: str,
    rows: int,
    threshold_source: str = "given",
) -> dict[str, Any]:
    """``out`` (Parquet: group, id, similarity_to_representative) and ``out``.summary.json; the summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "group": pa.array(found.group, type=pa.int64()),
            "id": pa.array([ids[r] for r in found.index], type=pa.string()),
            "similarity_to_representative": pa.array(found.similarity, type=pa.float32()),
        }
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    pq.write_table(table, partial)
    partial.replace(out)
    sizes = np.bincount(found.group) if len(found.group) else np.zeros(0, dtype=np.int64)
    summary = {
        "catalog": source,
        "rows": rows,
        "threshold": found.threshold,
        "threshold_source": threshold_source,
        "pairs_above_threshold": found.pairs,
        "groups": len(sizes),
        "rows_in_groups": len(found.group),
        "duplicates_to_drop": int(len(found.group) - len(sizes)),
        "largest_group": int(sizes.max()) if len(sizes) else 0,
        "representatives": [ids[r] for r in found.representative[:20]],
    }
    out.with_name(out.name + ".summary.json").write_text(json.dumps(summary, indent=1))
    return summary
