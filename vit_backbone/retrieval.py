"""Retrieval metrics for embeddings: cosine ranking of a query set against a gallery.

Used by ``bench/quality.py`` to choose the default pooling, layer and resize policy. Pure numpy, no model.

Definitions (one query row against all gallery rows, ranked by cosine similarity, ties broken by gallery
order):

- ``r1``: the top-ranked gallery item is relevant (for class labels: top-1 label accuracy; for copy
  detection: the top item is the query's source).
- ``hit_at_k``: at least one of the top ``k`` gallery items is relevant.
- ``p_at_k``: the fraction of the top ``k`` gallery items that are relevant.
- ``ap``: average precision over the *whole* gallery ranking: the mean, over every relevant gallery item, of
  the precision at its rank. With exactly one relevant item this is the reciprocal rank. ``map`` is its mean.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .errors import InvalidOptionError


@dataclass(frozen=True)
class RetrievalScores:
    r1: float
    hit_at_k: float
    p_at_k: float
    map: float
    k: int
    queries: int
    gallery: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows scaled to unit L2 norm (float64, so that rankings do not depend on float32 rounding)."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, eps)


def cosine_scores(queries: np.ndarray, gallery: np.ndarray) -> np.ndarray:
    """[Q, F] x [G, F] → [Q, G] cosine similarities."""
    if queries.ndim != 2 or gallery.ndim != 2 or queries.shape[1] != gallery.shape[1]:
        raise InvalidOptionError(
            f"queries and gallery must be [Q, F] and [G, F] with the same F, got "
            f"{list(queries.shape)} and {list(gallery.shape)}"
        )
    return l2_normalize(queries) @ l2_normalize(gallery).T


def relevance_ranking(scores: np.ndarray, query_labels: np.ndarray, gallery_labels: np.ndarray) -> np.ndarray:
    """[Q, G] bool: is the gallery item at each rank (best first) relevant to the query?"""
    query_labels, gallery_labels = np.asarray(query_labels), np.asarray(gallery_labels)
    if scores.shape != (len(query_labels), len(gallery_labels)):
        raise InvalidOptionError(
            f"scores {list(scores.shape)} do not match {len(query_labels)} queries x "
            f"{len(gallery_labels)} gallery items"
        )
    order = np.argsort(-scores, axis=1, kind="stable")  # [Q, G] gallery indices, best first
    return gallery_labels[order] == query_labels[:, None]  # [Q, G]


def per_query_metrics(relevant: np.ndarray, k: int = 10) -> dict[str, np.ndarray]:
    """Per-query r1, hit@k, p@k and AP from a [Q, G] ranked relevance matrix."""
    if relevant.ndim != 2 or relevant.shape[1] < 1:
        raise InvalidOptionError(f"relevance must be [Q, G] with G >= 1, got {list(relevant.shape)}")
    counts = relevant.sum(axis=1)  # [Q]
    if (counts == 0).any():
        raise InvalidOptionError(f"{int((counts == 0).sum())} queries have no relevant gallery item")
    k = min(k, relevant.shape[1])
    ranks = np.arange(1, relevant.shape[1] + 1)  # [G]
    precision = np.cumsum(relevant, axis=1) / ranks  # [Q, G] precision at each rank
    return {
        "r1": relevant[:, 0].astype(np.float64),
        "hit_at_k": relevant[:, :k].any(axis=1).astype(np.float64),
        "p_at_k": relevant[:, :k].mean(axis=1),
        "ap": (precision * relevant).sum(axis=1) / counts,
    }


def summarize(
    per_query: dict[str, np.ndarray], k: int, gallery: int, mask: np.ndarray | None = None
) -> RetrievalScores:
    """Means of per-query metrics, optionally over the queries selected by a boolean ``mask``."""
    chosen = {name: (v if mask is None else v[mask]) for name, v in per_query.items()}
    queries = len(chosen["r1"])
    if queries == 0:
        raise InvalidOptionError("no queries selected")
    return RetrievalScores(
        r1=float(chosen["r1"].mean()),
        hit_at_k=float(chosen["hit_at_k"].mean()),
        p_at_k=float(chosen["p_at_k"].mean()),
        map=float(chosen["ap"].mean()),
        k=k,
        queries=queries,
        gallery=gallery,
    )


def retrieval_scores(
    queries: np.ndarray,
    gallery: np.ndarray,
    query_labels: np.ndarray,
    gallery_labels: np.ndarray,
    *,
    k: int = 10,
) -> RetrievalScores:
    """Cosine retrieval of ``queries`` [Q, F] in ``gallery`` [G, F]; relevant = same label."""
    relevant = relevance_ranking(cosine_scores(queries, gallery), query_labels, gallery_labels)
    return summarize(per_query_metrics(relevant, k), k, len(gallery_labels))
