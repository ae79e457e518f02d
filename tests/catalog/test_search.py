"""``vitembed search``: query images embedded with the table's own options by a checkpoint whose revision and
preprocessing match (others refused, naming both sides), the same hits as the Python API for images and for
``--vector-file``, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from catalog_images import ImageTree
from test_index import BRANDS, TOL, embed_catalog, write_manifest

from catalog.index import build_index
from catalog.search import (
    InvalidVectorError,
    ModelMismatchError,
    SimilarityIndex,
    embed_queries,
    load_query_backbone,
)
from service.cli import main
from vit_backbone import Backbone


@pytest.fixture(scope="module")
def db(tree: ImageTree, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("search")
    catalog = embed_catalog(write_manifest(tree, tree.good, root / "m.csv"), root / "cat", tiny_path)
    build_index(catalog, root / "db", "products")
    return root / "db"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_json_equals_the_python_search(
    db: Path, tree: ImageTree, tiny: Backbone, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [tree.root / tree.good[3], tree.root / tree.good[10]]
    code, out, _ = cli(
        capsys, "search", "--db", str(db), "--table", "products", "--model", str(tiny_path), "--k", "4",
        "--json", *map(str, files),
    )  # fmt: skip
    assert code == 0
    payload = json.loads(out)
    index = SimilarityIndex.open(db, "products")
    vectors = embed_queries(tiny, index.meta, [f.read_bytes() for f in files])
    assert [q["query"] for q in payload["queries"]] == [str(f) for f in files]
    for query, vector, item in zip(payload["queries"], vectors, (tree.good[3], tree.good[10]), strict=True):
        expected = index.search(vector, k=4)
        assert [r["id"] for r in query["results"]] == [h.id for h in expected]
        assert query["results"][0]["id"] == item
        np.testing.assert_allclose(
            [r["score"] for r in query["results"]], [h.score for h in expected], atol=TOL
        )
        assert [r["metadata"] for r in query["results"]] == [h.metadata for h in expected]
    assert payload["index"]["rows"] == len(tree.good)
    assert payload["index"]["meta"] == index.meta.to_dict()


def test_cli_text_lists_rank_score_id_and_metadata(
    db: Path, tree: ImageTree, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    item = tree.good[0]
    code, out, _ = cli(
        capsys, "search", "--db", str(db), "--table", "products", "--model", str(tiny_path), "--k", "2",
        "--where", f"brand = '{BRANDS[0]}'", str(tree.root / item),
    )  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{tree.root / item}  (cosine, 2 results)"
    assert lines[1] == f"    1  +1.000000  {item}  brand={BRANDS[0]}"
    assert lines[2].endswith(f"brand={BRANDS[0]}") and len(lines) == 3


def test_vector_file_gives_the_same_hits(
    db: Path, tiny: Backbone, tree: ImageTree, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = SimilarityIndex.open(db, "products")
    vectors = embed_queries(tiny, index.meta, [(tree.root / tree.good[5]).read_bytes()])  # [1, D]
    np.save(tmp_path / "q.npy", vectors[0])
    code, out, _ = cli(capsys, "search", "--db", str(db), "--table", "products", "--vector-file",
                       str(tmp_path / "q.npy"), "--json", "--k", "3")  # fmt: skip
    assert code == 0
    [query] = json.loads(out)["queries"]
    expected = index.search(vectors[0], k=3)
    assert [r["id"] for r in query["results"]] == [h.id for h in expected] and expected[0].id == tree.good[5]
    np.testing.assert_allclose([r["score"] for r in query["results"]], [h.score for h in expected], atol=TOL)


def test_another_checkpoint_is_refused(
    db: Path, make_checkpoint: Any, tree: ImageTree, capsys: pytest.CaptureFixture[str]
) -> None:
    other = make_checkpoint("dinov2", seed=1)
    index = SimilarityIndex.open(db, "products")
    with pytest.raises(ModelMismatchError, match=f"the table needs {index.meta.revision}"):
        load_query_backbone(index.meta, str(other))
    code, _, err = cli(capsys, "search", "--db", str(db), "--table", "products", "--model", str(other),
                       str(tree.root / tree.good[0]))  # fmt: skip
    assert code == 2
    assert err.startswith(f"vitembed search: error: model '{other}' has revision local-")
    assert f"(the table needs {index.meta.revision})" in err and err.count("\n") == 1


def test_a_table_of_a_local_model_needs_model(
    db: Path, tree: ImageTree, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = SimilarityIndex.open(db, "products").meta
    code, _, err = cli(
        capsys, "search", "--db", str(db), "--table", "products", str(tree.root / tree.good[0])
    )
    assert code == 2
    assert err == (
        f"vitembed search: error: the table was embedded with model {meta.model!r} "
        f"(revision {meta.revision}), which cannot be loaded by that name: give its checkpoint folder or "
        "hub id with --model\n"
    )


def test_bad_queries_are_one_line_errors(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = SimilarityIndex.open(db, "products")
    with pytest.raises(InvalidVectorError, match=r"has shape \[16\]; index 'products' holds 32-dimensional"):
        index.search(np.ones(16, np.float32))
    with pytest.raises(InvalidVectorError, match="non-finite"):
        index.search(np.full(32, np.nan, np.float32))
    np.save(tmp_path / "q.npy", np.ones(32, np.float32))
    base = ["search", "--db", str(db), "--table", "products"]
    assert cli(capsys, *base, "--vector-file", str(tmp_path / "q.npy"), "--k", "0")[2] == (
        "vitembed search: error: k must be a whole number from 1 to 1000, got 0\n"
    )
    assert (
        cli(capsys, *base)[2]
        == "vitembed search: error: give query IMAGE files or --vector-file (one of them)\n"
    )
    code, _, err = cli(
        capsys, "search", "--db", str(tmp_path / "none"), "--table", "t", "--vector-file", "x.npy"
    )
    assert (code, err) == (
        2,
        f"vitembed search: error: LanceDB database {tmp_path / 'none'} does not exist; create it with "
        "`vitembed index build`\n",
    )
