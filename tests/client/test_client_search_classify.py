"""``search`` and ``classify`` against a real ``vitembed serve`` with an index (built by the real
``embed-catalog`` job and ``index build``) and a trained linear head: the client's hits and probabilities
equal the library's (ids, scores and probabilities to 1e-5), for the sync and the async client."""

from __future__ import annotations

import asyncio
import csv
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from clientserver import ServerProcess, start_server
from heads_synthetic import CLASSES, labelled_image, make_labelled_folder
from vitembed.cli.main import main
from vitembed_client import AsyncClient, Client, UnprocessableEntityError

from vit_backbone import Backbone
from vit_backbone.catalog.index_build import build_index
from vit_backbone.catalog.index_search import SimilarityIndex, embed_queries
from vit_backbone.heads import TrainOptions, load_head, save_head, train_head
from vit_backbone.heads.predict import predict_proba

TOL = 1e-5


@pytest.fixture(scope="module")
def served(
    tiny_path: Path, reference: Backbone, photos: list[bytes], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path, Path]]:
    root = tmp_path_factory.mktemp("client-search")
    with (root / "manifest.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "path", "brand"])
        for i, data in enumerate(photos[:10]):
            (root / f"p{i}.jpg").write_bytes(data)
            writer.writerow([f"p{i}", str(root / f"p{i}.jpg"), ("acme", "globex")[i % 2]])
    argv = [
        "embed-catalog",
        str(root / "manifest.csv"),
        "--out",
        str(root / "cat"),
        "--model",
        f"tiny={tiny_path}",
    ]
    assert main([*argv, "--precision", "float32"]) == 0
    build_index(root / "cat", root / "db", "products")
    labelled = make_labelled_folder(root / "labelled", per_class=6)
    head = train_head(reference, labelled, TrainOptions(kind="linear", pooling="mean", layers=(0, 1))).head
    save_head(head, root / "shapes.safetensors")
    flags = ("--index", f"products={root / 'db'}:products", "--head", f"shapes={root / 'shapes.safetensors'}")
    server = start_server(tiny_path, root, *flags)
    try:
        yield server, root / "db", root / "shapes.safetensors"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shapes() -> list[bytes]:
    out = []
    for c, label in enumerate(CLASSES):
        buffer = io.BytesIO()
        labelled_image(label, 700 + c).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def test_search_and_classify_equal_the_library(
    served: tuple[ServerProcess, Path, Path], reference: Backbone, photos: list[bytes], shapes: list[bytes]
) -> None:
    server, db, head_path = served
    index = SimilarityIndex.open(db, "products")
    queries = [photos[2], photos[12]]  # p2 is indexed (brand acme): its own row comes first
    vectors = embed_queries(reference, index.meta, queries)  # [2, D]
    expected = [[h.to_dict() for h in index.search(v, 4, "brand = 'acme'")] for v in vectors]
    probabilities = predict_proba(reference, load_head(head_path, reference), shapes)  # [3, 3]
    with Client(server.url) as client:
        by_image = client.search(queries, k=4, where="brand = 'acme'")
        by_vector = client.search(vector=vectors[1], k=4, where="brand = 'acme'")
        classified = client.classify(shapes, top_k=3)
        with pytest.raises(UnprocessableEntityError) as bad_filter:
            client.search(vector=vectors[0], where="nope ==")
    assert by_image.index == "products" and by_image.k == 4
    assert bad_filter.value.code == "invalid_filter" and bad_filter.value.request_id
    for got, want in zip([*by_image.hits, *by_vector.hits], [*expected, expected[1]], strict=True):
        assert [(h.id, h.metadata) for h in got] == [(w["id"], w["metadata"]) for w in want]
        np.testing.assert_allclose([h.score for h in got], [w["score"] for w in want], atol=TOL, rtol=0)
    assert by_image.hits[0][0].id == "p2" and by_image.provenance["model"] == "tiny"
    for item, row in zip(classified["data"], probabilities, strict=True):
        order = np.argsort(-row, kind="stable")
        assert [x["label"] for x in item["labels"]] == [CLASSES[i] for i in order]
        np.testing.assert_allclose([x["probability"] for x in item["labels"]], row[order], atol=TOL, rtol=0)


def test_async_search_and_classify_equal_the_sync_client(
    served: tuple[ServerProcess, Path, Path], photos: list[bytes], shapes: list[bytes]
) -> None:
    server = served[0]

    async def both() -> tuple[object, object]:
        async with AsyncClient(server.url) as client:
            return await client.search(photos[3], k=3), await client.classify(shapes[:2], top_k=2)

    found, classified = asyncio.run(both())
    with Client(server.url) as client:
        assert found == client.search(photos[3], k=3)
        assert classified == client.classify(shapes[:2], top_k=2)
