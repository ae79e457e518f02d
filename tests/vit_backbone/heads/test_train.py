"""Linear and kNN heads trained on a generated labelled folder (3 visibly different classes) with the tiny
random-init DINOv2: accuracy, the card's facts, the feature cache, and the Python prediction API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from heads_synthetic import CLASSES

from vit_backbone import Backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.heads import FeatureCache, TrainOptions, train_head
from vit_backbone.heads.data import read_labelled_folder
from vit_backbone.heads.features_cache import cached_features
from vit_backbone.heads.predict import predict_proba
from vit_backbone.heads.train import split


@pytest.mark.parametrize("kind", ["linear", "knn"])
def test_head_learns_visible_classes_and_its_card_is_right(
    kind: str, tiny: Backbone, labelled_folder: Path, fresh_folder: Path, tmp_path: Path
) -> None:
    result = train_head(tiny, labelled_folder, TrainOptions(kind=kind, pooling="mean"), cache=None)
    card = result.card
    assert card.val_accuracy == 1.0
    assert (card.kind, card.backbone, card.revision) == (kind, "dinov2", tiny.checkpoint.revision)
    assert card.preprocess_hash == tiny.preprocess_config.hash()
    assert (card.pooling, card.layers, card.size, card.policy, card.normalized) == (
        "mean",
        None,
        None,
        "crop",
        False,
    )
    assert card.feature_dim == 32
    assert card.classes == CLASSES
    assert (card.train_count, card.val_count) == (48, 12)  # 20 per class, 4 per class held out
    assert card.data == str(labelled_folder)
    if kind == "linear":
        assert set(card.hyperparameters) == {"weight_decay", "weight_decay_grid", "optimizer", "standardize"}
        assert card.hyperparameters["weight_decay_grid"][f"{card.hyperparameters['weight_decay']:g}"] == 1.0
    else:
        assert card.hyperparameters["temperature"] == 0.07
        assert card.hyperparameters["k_grid"][str(card.hyperparameters["k"])] == 1.0
    # unseen images of the same classes
    fresh = read_labelled_folder(fresh_folder)
    proba = predict_proba(tiny, result.head, [p.read_bytes() for p in fresh.paths])  # [24, 3]
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-5)
    accuracy = float((proba.argmax(axis=1) == np.asarray(fresh.labels)).mean())
    assert accuracy >= 0.95, accuracy


def test_random_labels_are_not_learned(tiny: Backbone, labelled_folder: Path, tmp_path: Path) -> None:
    """The accuracy above is the classes', not an artefact: shuffled labels fall to chance."""
    dataset = read_labelled_folder(labelled_folder)
    shuffled = np.random.default_rng(0).permutation(np.asarray(dataset.labels))
    for name in CLASSES:
        (tmp_path / name).mkdir()
    for path, label in zip(dataset.paths, shuffled, strict=True):
        (tmp_path / CLASSES[label] / f"{path.parent.name}-{path.name}").write_bytes(path.read_bytes())
    card = train_head(tiny, tmp_path, TrainOptions(kind="linear", pooling="mean")).card
    assert card.val_accuracy is not None and card.val_accuracy <= 0.6


def test_features_are_cached_across_kinds(tiny: Backbone, labelled_folder: Path, tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "cache")
    first = train_head(tiny, labelled_folder, TrainOptions(kind="linear", layers=(0,)), cache=cache)
    assert (first.cache.computed, first.cache.hits) == (60, 0)
    again = train_head(tiny, labelled_folder, TrainOptions(kind="knn", layers=(0,)), cache=cache)
    assert (again.cache.computed, again.cache.hits) == (0, 60)
    other = train_head(tiny, labelled_folder, TrainOptions(kind="knn", layers=(1,)), cache=cache)
    assert (other.cache.computed, other.cache.hits) == (60, 0)  # other blocks: other features
    assert first.card.layers == (0,)
    # a cached feature is the computed one
    uncached = train_head(tiny, labelled_folder, TrainOptions(kind="knn", layers=(0,)), cache=None)
    np.testing.assert_array_equal(uncached.head.tensors()["bank"], again.head.tensors()["bank"])


def test_stratified_split() -> None:
    labels = np.asarray([0] * 10 + [1] * 5 + [2])
    train, val = split(labels, 0.2, seed=0)
    assert sorted(np.bincount(labels[val], minlength=3).tolist()) == [0, 1, 2]
    assert np.bincount(labels[val], minlength=3).tolist() == [2, 1, 0]
    assert sorted([*train.tolist(), *val.tolist()]) == list(range(16))
    _, again_val = split(labels, 0.2, seed=0)
    np.testing.assert_array_equal(val, again_val)


def test_bad_folders_are_refused(tiny: Backbone, tmp_path: Path) -> None:
    (tmp_path / "only").mkdir()
    with pytest.raises(InvalidOptionError, match=r"one subfolder per class \(at least 2\), found 1"):
        train_head(tiny, tmp_path, TrainOptions())
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidOptionError, match=r"class folder .*empty holds no images"):
        read_labelled_folder(tmp_path)
    with pytest.raises(InvalidOptionError, match=r"use --kind patch"):
        train_head(tiny, tmp_path, TrainOptions(pooling="patch"))
    with pytest.raises(InvalidOptionError, match=r"val_fraction must be in"):
        TrainOptions(val_fraction=1.0)


def test_uncached_files_are_read_one_chunk_at_a_time(
    tiny: Backbone, labelled_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No list of every file's bytes: a chunk's files are read when that chunk is embedded, so memory is
    bounded by the chunk whatever the folder's size; the features equal the all-at-once ones."""
    import vit_backbone.heads.features_cache as features_cache

    files = sorted(labelled_folder.rglob("*.png"))[:10]
    expected = cached_features(tiny, files, pooling="mean", layers=None, size=None, policy="crop", cache=None)
    events: list[str] = []
    real_read, real_embed = Path.read_bytes, tiny.embed_prepared

    def reading(path: Path) -> bytes:
        events.append("read")
        return real_read(path)

    def embedding(prepared: Any, **options: Any) -> Any:
        events.append("embed")
        return real_embed(prepared, **options)

    monkeypatch.setattr(features_cache, "_CHUNK", 4)
    monkeypatch.setattr(Path, "read_bytes", reading)
    monkeypatch.setattr(tiny, "embed_prepared", embedding)
    cache = FeatureCache(tmp_path / "cache")
    got = cached_features(tiny, files, pooling="mean", layers=None, size=None, policy="crop", cache=cache)
    assert events == ["read"] * 4 + ["embed"] + ["read"] * 4 + ["embed"] + ["read"] * 2 + ["embed"]
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)
