"""``vitembed search``: query images embedded with the table's own options by a checkpoint whose revision and
preprocessing match (others refused, naming both sides), the same hits as the Python API for images and for
``--vector-file``, and one-line errors for bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from catalog_images import ImageTree
from test_index import BRANDS, TOL, embed_catalog, write_manifest
from vitembed.cli.main import main

from vit_backbone import Backbone
from vit_backbone.catalog.index_build import (
    IndexOptions,
    InvalidFilterError,
    build_index,
    connect,
    create_table,
)
from vit_backbone.catalog.index_search import (
    IndexChangedError,
    IndexDroppedError,
    InvalidVectorError,
    ModelMismatchError,
    SimilarityIndex,
    embed_queries,
    load_query_backbone,
)
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shards import read_catalog


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


def test_cosine_scores_never_leave_minus_one_to_one(db: Path, tiny: Backbone, tree: ImageTree) -> None:
    index = SimilarityIndex.open(db, "products")
    queries = embed_queries(
        tiny, index.meta, [(tree.root / name).read_bytes() for name in tree.good]
    )  # [Q, D]
    scores = [hit.score for hits in index.search_many(list(queries), 3) for hit in hits]
    assert 1.0 - 1e-6 <= max(scores) <= 1.0  # an image's own row: not 1.0000001 from float32 rounding
    assert all(-1.0 <= score <= 1.0 for score in scores)


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


def test_a_table_of_a_local_model_is_searched_with_the_recorded_location(
    db: Path, tiny_path: Path, tree: ImageTree, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    meta = SimilarityIndex.open(db, "products").meta
    assert meta.model_location == str(tiny_path.resolve())  # recorded by embed-catalog, carried by the index
    query = str(tree.root / tree.good[0])
    code, out, err = cli(
        capsys, "search", "--db", str(db), "--table", "products", query, "--json", "--k", "1"
    )
    assert code == 0, err  # no --model needed
    assert json.loads(out)["queries"][0]["results"][0]["id"] == tree.good[0]

    moved = replace(meta, model_location=str(tmp_path / "gone"))
    with pytest.raises(ModelMismatchError) as caught:
        load_query_backbone(moved)
    assert str(caught.value) == (
        f"the table was embedded with model {meta.model!r} from {tmp_path / 'gone'}, which is not there "
        "any more: give its checkpoint folder or hub id with --model"
    )
    assert load_query_backbone(moved, str(tiny_path)).facts.revision == meta.revision  # the flag overrides
    unrecorded = replace(meta, model_location=None)  # a table from before locations were recorded
    with pytest.raises(ModelMismatchError, match="cannot be loaded by that name: give its checkpoint folder"):
        load_query_backbone(unrecorded)


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


# ------------------------------------------------------------------------------------------- review fixes
def _synthetic_meta(dim: int, **changes: Any) -> CatalogMeta:
    meta = CatalogMeta("synthetic", "r0", "p0", "cls", None, None, "crop", False, dim, "float32")
    return replace(meta, **changes)


def test_filters_failing_at_execution_are_invalid_filters(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    index = SimilarityIndex.open(db, "products")
    query = np.ones(32, np.float32)
    for where, reason in [
        ("CAST(brand AS INT) > 5", "Query Execution error: Error applying filter expression to batch: Arrow "
         "error: Cast error: Cannot cast string 'acme' to value of Int32 type"),
        ("1/0 = 1", "Query Execution error: Error applying filter expression to batch: Arrow error: Divide "
         "by zero error"),
    ]:  # fmt: skip
        with pytest.raises(InvalidFilterError) as caught:
            index.search(query, 3, where)
        assert str(caught.value) == f"invalid where filter: {reason}"
    semicolon = (
        "invalid where filter: ';' is not allowed outside a quoted string; give one SQL predicate, "
        "e.g. brand = 'acme' AND price < '10'"
    )
    with pytest.raises(InvalidFilterError) as caught:
        index.search(query, 3, "brand = 'acme'; DROP TABLE products")
    assert str(caught.value) == semicolon
    assert index.search(query, 3, "brand = 'a;b'") == []  # inside a literal it is just a character
    base = ["search", "--db", str(db), "--table", "products", "--vector-file"]
    np.save(tmp_path / "q.npy", query)
    code, out, err = cli(capsys, *base, str(tmp_path / "q.npy"), "--where", "1/0 = 1")
    assert (code, out) == (2, "")
    assert err == (
        "vitembed search: error: invalid where filter: Query Execution error: Error applying filter "
        "expression to batch: Arrow error: Divide by zero error\n"
    )
    # index delete: the same errors, and nothing deleted
    copy = tmp_path / "db"
    catalog = read_catalog(db.parent / "cat")
    create_table(copy, "t", catalog.ids, catalog.embeddings, catalog.meta, extra=catalog.extra)
    for where, message in [("1/0 = 1", "Divide by zero error"), ("brand = 'x'; true", "';' is not allowed")]:
        code, _, err = cli(capsys, "index", "delete", "--db", str(copy), "--table", "t", "--where", where)
        assert code == 2 and err.startswith("vitembed index: error: invalid where filter: ")
        assert message in err and err.count("\n") == 1
    assert SimilarityIndex.open(copy, "t").count() == len(catalog.ids)


def test_degenerate_query_vectors(db: Path, tmp_path: Path) -> None:
    index = SimilarityIndex.open(db, "products")
    catalog = read_catalog(db.parent / "cat")
    zero = "the query vector has zero (or subnormal) length: it has no direction to compare by cosine"
    for vector in (np.zeros(32, np.float32), np.full(32, 1e-45, np.float32)):  # zero, subnormal
        with pytest.raises(InvalidVectorError) as caught:
            index.search(vector, 3)
        assert str(caught.value) == zero
    with pytest.raises(InvalidVectorError, match="non-finite"):
        index.search(np.full(32, np.inf, np.float32), 3)
    # cosine ignores length: huge and tiny (but normal) multiples rank and score as the vector itself
    own = index.search(catalog.embeddings[4], 3)
    for scale in (1e30, 1e-30):
        hits = index.search(catalog.embeddings[4].astype(np.float64) * scale, 3)
        assert [h.id for h in hits] == [h.id for h in own] and hits[0].id == catalog.ids[4]
        np.testing.assert_allclose([h.score for h in hits], [h.score for h in own], atol=TOL)
    # dot: an inner product that overflows float32 is refused, not returned as infinity
    vectors = np.random.default_rng(0).standard_normal((20, 8)).astype(np.float32)
    create_table(tmp_path / "db", "dot", [str(i) for i in range(20)], vectors, _synthetic_meta(8),
                 options=IndexOptions("dot"))  # fmt: skip
    with pytest.raises(InvalidVectorError, match="the query's scores are not finite"):
        SimilarityIndex.open(tmp_path / "db", "dot").search(np.full(8, 1e38, np.float32), 3)


def test_vector_queries_to_a_normalized_table_are_normalized(tmp_path: Path) -> None:
    """A dot table of unit vectors scores a vector query by its cosine, as an image query (embedded with
    the table's normalize) would be."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((30, 8))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)  # [30, 8]
    meta = _synthetic_meta(8, normalized=True)
    create_table(
        tmp_path / "db", "t", [str(i) for i in range(30)], vectors, meta, options=IndexOptions("dot")
    )
    index = SimilarityIndex.open(tmp_path / "db", "t")
    hits = index.search(vectors[7] * 5.0, 3)
    assert hits[0].id == "7" and hits[0].score == pytest.approx(1.0, abs=TOL)
    reference = vectors.astype(np.float64) @ vectors[7].astype(np.float64)  # [30]: cosines
    np.testing.assert_allclose([h.score for h in hits], reference[[int(h.id) for h in hits]], atol=TOL)
    with pytest.raises(InvalidVectorError, match="no direction to compare by a normalised index"):
        index.search(np.zeros(8, np.float32), 3)


def test_a_table_overwritten_or_dropped_under_an_open_handle(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    ids = [str(i) for i in range(10)]
    create_table(
        tmp_path / "db", "t", ids, rng.standard_normal((10, 8)).astype(np.float32), _synthetic_meta(8)
    )
    index = SimilarityIndex.open(tmp_path / "db", "t")
    fresh = rng.standard_normal((10, 8)).astype(np.float32)
    # rebuilt with the same options: still the same meaning, searched as it is now
    create_table(tmp_path / "db", "t", ids, fresh, _synthetic_meta(8), overwrite=True)
    assert index.search(fresh[2], 1)[0].id == "2"
    create_table(tmp_path / "db", "t", ids, rng.standard_normal((10, 16)).astype(np.float32),
                 _synthetic_meta(16, pooling="mean"), overwrite=True)  # fmt: skip
    for call in (lambda: index.search(fresh[2], 1), index.describe):
        with pytest.raises(IndexChangedError) as caught:
            call()
        assert str(caught.value) == (
            f"table 't' in {tmp_path / 'db'} was rebuilt with other options since it was opened "
            "(pooling: 'cls' -> 'mean'; dim: 8 -> 16); reopen it"
        )
    connect(tmp_path / "db").drop_table("t")
    with pytest.raises(IndexDroppedError, match=f"table 't' is no longer in {tmp_path / 'db'} "):
        index.search(fresh[2], 1)


def test_queries_are_embedded_in_the_table_s_precision(db: Path, tiny_path: Path, tmp_path: Path) -> None:
    meta = SimilarityIndex.open(db, "products").meta
    assert meta.precision == "float32"
    assert load_query_backbone(meta, str(tiny_path)).autocast is None
    assert load_query_backbone(replace(meta, precision="bfloat16"), str(tiny_path)).autocast == torch.bfloat16
    assert load_query_backbone(replace(meta, precision=None), str(tiny_path)).autocast is None
    # float16 needs CUDA: a CPU embeds in float32 instead of failing
    backbone = load_query_backbone(replace(meta, precision="float16"), str(tiny_path))
    assert backbone.autocast is (torch.float16 if backbone.device.type == "cuda" else None)


def test_bad_vector_files_are_one_line_errors(
    db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["search", "--db", str(db), "--table", "products", "--vector-file"]
    (tmp_path / "text.npy").write_text("0.1 0.2 0.3\n")
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    np.save(tmp_path / "cube.npy", np.ones((2, 2, 32), np.float32))
    for name, message in [
        ("text.npy", f"--vector-file {tmp_path / 'text.npy'} is not a .npy file (write one with numpy.save)"),
        ("objects.npy", f"--vector-file {tmp_path / 'objects.npy'} is not a readable .npy array of numbers "
         "(Object arrays cannot be loaded when allow_pickle=False)"),
        ("strings.npy", f"--vector-file {tmp_path / 'strings.npy'} must hold one numeric .npy array of shape "
         "[D] or [Q, D]"),
        ("cube.npy", f"--vector-file {tmp_path / 'cube.npy'} must hold one numeric .npy array of shape [D] "
         "or [Q, D]"),
        ("missing.npy", f"--vector-file {tmp_path / 'missing.npy'} cannot be read (No such file or "
         "directory)"),
    ]:  # fmt: skip
        code, out, err = cli(capsys, *base, str(tmp_path / name))
        assert (code, out) == (2, ""), name
        assert err.startswith(f"vitembed search: error: {message}"), err
        assert err.count("\n") == 1
