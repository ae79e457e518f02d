"""Retrieval metrics against hand-computed rankings."""

from __future__ import annotations

import numpy as np
import pytest

from vit_backbone.errors import InvalidOptionError
from vit_backbone.retrieval import (
    cosine_scores,
    l2_normalize,
    per_query_metrics,
    relevance_ranking,
    retrieval_scores,
    summarize,
)


def test_cosine_ignores_scale() -> None:
    q = np.array([[1.0, 0.0], [3.0, 4.0]])
    g = np.array([[10.0, 0.0], [0.0, 0.5]])
    np.testing.assert_allclose(cosine_scores(q, g), [[1.0, 0.0], [0.6, 0.8]])
    np.testing.assert_allclose(np.linalg.norm(l2_normalize(q), axis=1), 1.0)


def test_zero_vector_does_not_produce_nan() -> None:
    assert np.isfinite(cosine_scores(np.zeros((1, 3)), np.ones((2, 3)))).all()


def test_average_precision_by_hand() -> None:
    # ranking for one query: relevant at ranks 1, 3 -> AP = (1/1 + 2/3) / 2
    relevant = np.array([[True, False, True, False]])
    m = per_query_metrics(relevant, k=2)
    assert m["r1"][0] == 1.0
    assert m["hit_at_k"][0] == 1.0
    assert m["p_at_k"][0] == 0.5
    assert m["ap"][0] == pytest.approx((1 + 2 / 3) / 2)


def test_single_relevant_item_gives_reciprocal_rank() -> None:
    relevant = np.array([[False, False, True, False], [True, False, False, False]])
    m = per_query_metrics(relevant, k=2)
    np.testing.assert_allclose(m["ap"], [1 / 3, 1.0])
    np.testing.assert_allclose(m["r1"], [0.0, 1.0])
    np.testing.assert_allclose(m["hit_at_k"], [0.0, 1.0])


def test_ranking_follows_scores_and_labels() -> None:
    scores = np.array([[0.1, 0.9, 0.5]])
    ranked = relevance_ranking(scores, np.array([7]), np.array([7, 3, 7]))
    assert ranked.tolist() == [[False, True, True]]  # order: gallery 1 (label 3), 2 (7), 0 (7)


def test_retrieval_scores_end_to_end() -> None:
    gallery = np.array([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]])
    queries = np.array([[0.9, 0.1], [0.1, 0.9]])
    s = retrieval_scores(queries, gallery, np.array([0, 1]), np.array([0, 1, 1]), k=2)
    assert s.r1 == 1.0
    # query 0: ranking 0 (rel), 2, 1 -> AP 1; query 1: ranking 1 (rel), 2 (rel), 0 -> AP 1
    assert s.map == pytest.approx(1.0)
    assert s.p_at_k == pytest.approx((0.5 + 1.0) / 2)
    assert (s.queries, s.gallery, s.k) == (2, 3, 2)


def test_summarize_with_mask() -> None:
    relevant = np.array([[True, False], [False, True]])
    m = per_query_metrics(relevant, k=1)
    assert summarize(m, 1, 2, mask=np.array([False, True])).r1 == 0.0
    with pytest.raises(InvalidOptionError):
        summarize(m, 1, 2, mask=np.array([False, False]))


def test_errors() -> None:
    with pytest.raises(InvalidOptionError):
        cosine_scores(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(InvalidOptionError):
        per_query_metrics(np.array([[False, False]]))
    with pytest.raises(InvalidOptionError):
        relevance_ranking(np.zeros((1, 2)), np.array([0]), np.array([0, 1, 2]))
