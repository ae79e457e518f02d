"""Heads trained on catalog Parquet (id, embedding, label + the b"vitembed" metadata) instead of images."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vit_backbone import Backbone, load_backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.heads import HeadMismatchError, TrainOptions, train_head
from vit_backbone.heads.data import read_embedding_parquet, read_labelled_folder
from vit_backbone.heads.predict import predict_proba


def catalog_meta(backbone: Backbone, **changes: Any) -> dict[str, Any]:
    meta = {
        "model": "tiny",
        "revision": backbone.checkpoint.revision,
        "preprocess_hash": backbone.preprocess_config.hash(),
        "pooling": "mean",
        "layers": [0],
        "size": None,
        "policy": "crop",
        "normalized": True,
        "dim": 32,
        "dtype": "float16",
        "format_version": 1,
    }
    return {**meta, **changes}


def write_shard(
    path: Path, ids: list[str], vectors: np.ndarray, labels: list[Any], meta: dict[str, Any] | None
) -> None:
    dtype = pa.float16() if vectors.dtype == np.float16 else pa.float32()
    flat = pa.array(vectors.reshape(-1), type=dtype)
    table = pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]),
            "label": pa.array(labels, type=pa.string()),
        }
    )
    if meta is not None:
        table = table.replace_schema_metadata({b"vitembed": json.dumps(meta).encode()})
    pq.write_table(table, path)


@pytest.fixture(scope="module")
def catalog(tiny: Backbone, labelled_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two float16 shards of normalised block-0 mean vectors, as `vitembed embed-catalog` writes them."""
    dataset = read_labelled_folder(labelled_folder)
    vectors = tiny.embed([p.read_bytes() for p in dataset.paths], pooling="mean", layers=[0], normalize=True)
    ids = [str(p.relative_to(labelled_folder)) for p in dataset.paths]
    labels = [dataset.classes[i] for i in dataset.labels]
    folder = tmp_path_factory.mktemp("catalog")
    half = len(ids) // 2
    for part, rows in enumerate((slice(0, half), slice(half, None))):
        write_shard(
            folder / f"part-{part:05d}.parquet",
            ids[rows],
            vectors[rows].astype(np.float16),
            labels[rows],
            catalog_meta(tiny),
        )
    return folder


@pytest.mark.parametrize("kind", ["linear", "knn"])
def test_train_from_catalog_vectors(kind: str, catalog: Path, tiny: Backbone, fresh_folder: Path) -> None:
    head = train_head(None, catalog, TrainOptions(kind=kind)).head
    card = head.card
    assert card.val_accuracy == 1.0
    assert (card.backbone, card.revision, card.preprocess_hash) == (
        "tiny",
        tiny.checkpoint.revision,
        tiny.preprocess_config.hash(),
    )
    assert (card.pooling, card.layers, card.size, card.policy, card.normalized, card.feature_dim) == (
        "mean",
        (0,),
        None,
        "crop",
        True,
        32,
    )
    assert (card.train_count, card.val_count) == (48, 12)
    assert card.classes == ("blue_square", "green_triangle", "red_circle")
    # served on raw (unnormalised) backbone features, the head normalises them as the catalog did
    fresh = read_labelled_folder(fresh_folder)
    proba = predict_proba(tiny, head, [p.read_bytes() for p in fresh.paths])
    assert float((proba.argmax(1) == np.asarray(fresh.labels)).mean()) >= 0.95


def test_catalog_read_exactly(catalog: Path, tiny: Backbone) -> None:
    table = read_embedding_parquet(catalog)
    assert len(table.ids) == 60 and table.features.shape == (60, 32) and table.features.dtype == np.float32
    assert table.ids[0] == "blue_square/000.png"
    assert table.meta == catalog_meta(tiny)
    one = read_embedding_parquet(catalog / "part-00000.parquet")
    np.testing.assert_array_equal(one.features, table.features[:30])


def test_catalog_of_another_backbone_is_refused(catalog: Path, make_checkpoint: Callable[..., Path]) -> None:
    other = load_backbone(make_checkpoint("dinov2", seed=1))
    with pytest.raises(HeadMismatchError) as caught:
        train_head(other, catalog, TrainOptions())
    assert str(caught.value) == (
        f"a head on the vectors in {str(catalog)!r} does not match backbone 'dinov2': "
        f"revision {read_embedding_parquet(catalog).meta['revision']} != {other.checkpoint.revision}"
    )


def test_bad_catalogs_are_refused(tmp_path: Path, tiny: Backbone) -> None:
    vectors = np.eye(4, 32, dtype=np.float32)
    write_shard(tmp_path / "nometa.parquet", list("abcd"), vectors, ["x", "y", "x", "y"], None)
    with pytest.raises(InvalidOptionError, match=r"has no vitembed metadata"):
        read_embedding_parquet(tmp_path / "nometa.parquet")
    meta = catalog_meta(tiny, dim=32)
    write_shard(tmp_path / "nolabel.parquet", list("abcd"), vectors, ["x", None, "x", "y"], meta)
    with pytest.raises(InvalidOptionError, match=r"1 row\(s\) have no label \(e.g. id 'b'\)"):
        read_embedding_parquet(tmp_path / "nolabel.parquet")
    write_shard(tmp_path / "ok.parquet", list("abcd"), vectors, ["x", "y", "x", "y"], meta)
    with pytest.raises(InvalidOptionError, match=r"policy, pooling cannot be chosen for Parquet input"):
        train_head(None, tmp_path / "ok.parquet", TrainOptions(pooling="cls", policy="pad"))
    with pytest.raises(InvalidOptionError, match=r"patch heads need images and masks"):
        train_head(None, tmp_path / "ok.parquet", TrainOptions(kind="patch"))
    write_shard(
        tmp_path / "wrongdim.parquet", list("abcd"), vectors, ["x", "y", "x", "y"], catalog_meta(tiny, dim=16)
    )
    with pytest.raises(InvalidOptionError, match=r"embeddings are not all 16-dimensional"):
        read_embedding_parquet(tmp_path / "wrongdim.parquet")
