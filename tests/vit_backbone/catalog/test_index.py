"""``vitembed index build|add|delete`` on real catalogs (written by the real ``embed-catalog`` job on
generated JPEG/PNG files, tiny DINOv2 in float32) and real LanceDB tables: every image finds itself first
with score 1, exact search equals a float64 numpy brute force for cosine and dot, add and delete show in
counts and hits, ``where`` filters work, a catalog made with other options is refused, and the IVF-PQ index
appears once the table passes the threshold."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from catalog_images import ImageTree
from vitembed.cli.main import main

import vit_backbone.catalog.index_search as search_module
from vit_backbone import Backbone
from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.index_build import (
    MIN_ANN_ROWS,
    IndexOptions,
    IndexStoreError,
    InvalidFilterError,
    OptionsMismatchError,
    add_catalog,
    build_index,
    connect,
    create_table,
    delete_rows,
    has_ann,
    open_table,
    table_names,
)
from vit_backbone.catalog.index_search import SimilarityIndex, embed_queries
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shards import build_table, read_catalog, write_shard

TOL = 1e-5
BRANDS = ("acme", "globex", "initech")


def brute_force(vectors: np.ndarray, query: np.ndarray, metric: str) -> np.ndarray:
    """[N] float64 similarities of every row to ``query``."""
    x, q = vectors.astype(np.float64), query.astype(np.float64)
    if metric == "cosine":
        return (x @ q) / (np.linalg.norm(x, axis=1) * np.linalg.norm(q))
    return x @ q


def write_manifest(tree: ImageTree, ids: Sequence[str], path: Path) -> Path:
    """A CSV manifest with a ``brand`` metadata column (cycling BRANDS by position in ``tree.good``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "path", "brand"])
        for item in ids:
            writer.writerow([item, str(tree.root / item), BRANDS[tree.good.index(item) % len(BRANDS)]])
    return path


def embed_catalog(source: Path, out: Path, model: Path, *flags: str) -> Path:
    code = main(
        [
            "embed-catalog",
            str(source),
            "--out",
            str(out),
            "--model",
            str(model),
            "--precision",
            "float32",
            *flags,
        ]
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def catalogs(tree: ImageTree, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``all``: every good image with a brand column; ``first``/``second``: overlapping halves; ``cls``: the
    first half embedded with another pooling."""
    root = tmp_path_factory.mktemp("index-catalogs")
    good = tree.good
    return {
        "all": embed_catalog(write_manifest(tree, good, root / "all.csv"), root / "cat-all", tiny_path),
        "first": embed_catalog(write_manifest(tree, good[:8], root / "a.csv"), root / "cat-a", tiny_path),
        "second": embed_catalog(write_manifest(tree, good[6:], root / "b.csv"), root / "cat-b", tiny_path),
        "mean": embed_catalog(
            write_manifest(tree, good[:3], root / "c.csv"), root / "cat-c", tiny_path, "--pooling", "mean"
        ),
    }


def test_every_image_finds_itself_first(
    catalogs: dict[str, Path], tree: ImageTree, tiny: Backbone, tmp_path: Path
) -> None:
    report = build_index(catalogs["all"], tmp_path / "db", "products")
    assert (report.rows, report.inserted, report.ann) == (len(tree.good), len(tree.good), False)
    index = SimilarityIndex.open(tmp_path / "db", "products")
    queries = embed_queries(
        tiny, index.meta, [(tree.root / item).read_bytes() for item in tree.good]
    )  # [n, D]
    for item, vector in zip(tree.good, queries, strict=True):
        hits = index.search(vector, k=3)
        assert hits[0].id == item
        assert hits[0].score == pytest.approx(1.0, abs=TOL)
        assert hits[0].metadata == {"brand": BRANDS[tree.good.index(item) % len(BRANDS)]}
        assert hits[0].score > hits[1].score >= hits[2].score


@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_exact_search_equals_numpy_brute_force(
    catalogs: dict[str, Path], metric: str, tmp_path: Path
) -> None:
    catalog = read_catalog(catalogs["all"])
    build_index(catalogs["all"], tmp_path / "db", "t", metric=metric)  # type: ignore[arg-type]
    index = SimilarityIndex.open(tmp_path / "db", "t")
    assert index.metric == metric
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((5, catalog.meta.dim)).astype(np.float32)
    queries = np.concatenate([catalog.embeddings, catalog.embeddings[:5] + noise])  # [n + 5, D]
    k = 7
    for query in queries:
        reference = brute_force(catalog.embeddings, query, metric)  # [N]
        order = np.argsort(-reference, kind="stable")[:k]
        hits = index.search(query, k=k)
        assert [h.id for h in hits] == [catalog.ids[i] for i in order]
        np.testing.assert_allclose([h.score for h in hits], reference[order], rtol=0, atol=TOL)


def test_add_and_delete_are_reflected_in_search(
    catalogs: dict[str, Path], tree: ImageTree, tmp_path: Path
) -> None:
    db = tmp_path / "db"
    first, second = read_catalog(catalogs["first"]), read_catalog(catalogs["second"])
    build_index(catalogs["first"], db, "t")
    index = SimilarityIndex.open(db, "t")
    newcomer = second.ids[-1]
    vector = second.embeddings[-1]
    assert index.count() == 8
    assert index.search(vector, k=1)[0].id != newcomer

    report = add_catalog(catalogs["second"], db, "t")
    overlap = len(set(first.ids) & set(second.ids))
    assert (report.inserted, report.updated, report.rows) == (
        len(second.ids) - overlap,
        overlap,
        len(tree.good),
    )
    assert index.count() == len(tree.good)  # the same open handle sees the new rows
    hit = index.search(vector, k=1)[0]
    assert (hit.id, hit.score) == (newcomer, pytest.approx(1.0, abs=TOL))

    report = delete_rows(db, "t", ids=[newcomer, "no-such-id"])
    assert (report.deleted, report.rows, index.count()) == (1, len(tree.good) - 1, len(tree.good) - 1)
    assert newcomer not in [h.id for h in index.search(vector, k=len(tree.good))]

    acme = [i for i in tree.good if i != newcomer and BRANDS[tree.good.index(i) % 3] == "acme"]
    report = delete_rows(db, "t", where="brand = 'acme'")
    assert (report.deleted, report.rows) == (len(acme), len(tree.good) - 1 - len(acme))
    assert not {h.id for h in index.search(vector, k=50)} & set(acme)


def test_where_filter_selects_before_ranking(catalogs: dict[str, Path], tmp_path: Path) -> None:
    catalog = read_catalog(catalogs["all"])
    build_index(catalogs["all"], tmp_path / "db", "t")
    index = SimilarityIndex.open(tmp_path / "db", "t")
    brands = np.asarray(catalog.extra["brand"])
    chosen = np.flatnonzero(brands == "globex")
    query = catalog.embeddings[0]  # an acme row: its own id must not come back
    hits = index.search(query, k=50, where="brand = 'globex'")
    reference = brute_force(catalog.embeddings[chosen], query, "cosine")
    order = np.argsort(-reference, kind="stable")
    assert [h.id for h in hits] == [catalog.ids[chosen[i]] for i in order]
    np.testing.assert_allclose([h.score for h in hits], reference[order], atol=TOL)
    assert {h.metadata["brand"] for h in hits} == {"globex"}
    with pytest.raises(InvalidFilterError, match="No field named brnd"):
        index.search(query, k=3, where="brnd = 'globex'")


def test_add_refuses_a_catalog_made_with_other_options(
    catalogs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_index(catalogs["first"], tmp_path / "db", "t")
    with pytest.raises(OptionsMismatchError, match="pooling: cls != mean"):
        add_catalog(catalogs["mean"], tmp_path / "db", "t")
    capsys.readouterr()
    code = main(["index", "add", str(catalogs["mean"]), "--db", str(tmp_path / "db"), "--table", "t"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("vitembed index: error: catalog ") and "pooling: cls != mean" in err
    assert err.count("\n") == 1
    assert SimilarityIndex.open(tmp_path / "db", "t").count() == 8  # nothing was written


def test_build_refuses_to_replace_without_overwrite(catalogs: dict[str, Path], tmp_path: Path) -> None:
    build_index(catalogs["first"], tmp_path / "db", "t")
    with pytest.raises(IndexStoreError, match="already exists"):
        build_index(catalogs["all"], tmp_path / "db", "t")
    report = build_index(catalogs["all"], tmp_path / "db", "t", overwrite=True, metric="dot")
    index = SimilarityIndex.open(tmp_path / "db", "t")
    assert (report.rows, index.count(), index.metric) == (12, 12, "dot")


def test_metadata_survives_reopen_add_delete(catalogs: dict[str, Path], tmp_path: Path) -> None:
    build_index(catalogs["first"], tmp_path / "db", "t", ann_threshold=5000)
    add_catalog(catalogs["second"], tmp_path / "db", "t")
    delete_rows(tmp_path / "db", "t", where="brand = 'initech'")
    index = SimilarityIndex.open(tmp_path / "db", "t")
    assert index.meta == read_catalog(catalogs["first"]).meta
    assert index.options == IndexOptions(metric="cosine", ann_threshold=5000)


# ------------------------------------------------------------------------------------------- ANN
def _random_catalog(folder: Path, ids: list[str], vectors: np.ndarray) -> Path:
    meta = CatalogMeta(
        model="synthetic",
        revision="r0",
        preprocess_hash="p0",
        pooling="cls",
        layers=None,
        size=None,
        policy="crop",
        normalized=False,
        dim=vectors.shape[1],
        dtype="float32",
    )
    folder.mkdir(parents=True)
    write_shard(folder, 0, build_table(ids, vectors, {}, meta))
    return folder


def test_ann_index_is_built_past_the_threshold(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((700, 32)).astype(np.float32)  # [700, 32]
    ids = [f"item-{i:04d}" for i in range(700)]
    first = _random_catalog(tmp_path / "a", ids[:400], vectors[:400])
    second = _random_catalog(tmp_path / "b", ids[400:], vectors[400:])
    threshold = 500
    assert threshold >= MIN_ANN_ROWS

    report = build_index(first, tmp_path / "db", "t", ann_threshold=threshold)
    assert (report.rows, report.ann, report.ann_built) == (400, False, False)
    report = add_catalog(second, tmp_path / "db", "t")  # 700 rows: past the threshold
    assert (report.rows, report.ann, report.ann_built) == (700, True, True)
    table = open_table(tmp_path / "db", "t")
    assert has_ann(table)
    [config] = table.list_indices()
    assert (config.index_type, list(config.columns)) == ("IvfPq", ["vector"])
    assert table.index_stats(config.name).distance_type == "cosine"

    index = SimilarityIndex.open(tmp_path / "db", "t")
    for row in (0, 123, 450, 699):
        hits = index.search(vectors[row], k=5)
        assert hits[0].id == ids[row]
        assert hits[0].score == pytest.approx(1.0, abs=TOL)  # refined: exact scores
        # approximate: the set may miss a true neighbour, but each returned score is the exact similarity
        position = {item: i for i, item in enumerate(ids)}
        reference = brute_force(vectors, vectors[row], "cosine")  # [700]
        np.testing.assert_allclose(
            [h.score for h in hits], [reference[position[h.id]] for h in hits], atol=TOL
        )
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)

    # the query plan goes through the IVF index (a flat scan with --exact) ...
    assert "ANNSubIndex" in index.explain(vectors[0], k=5)
    assert "ANNSubIndex" not in index.explain(vectors[0], k=5, exact=True)
    # ... and finds the true neighbours of queries that are not rows: recall@5 against brute force
    queries = vectors[:60] + 0.5 * rng.standard_normal((60, 32)).astype(np.float32)  # [60, 32]
    found = 0
    for query in queries:
        truth = np.argsort(-brute_force(vectors, query, "cosine"), kind="stable")[:5]
        found += len({ids[i] for i in truth} & {h.id for h in index.search(query, k=5)})
    assert found / (5 * len(queries)) >= 0.85  # measured 0.92: isotropic random data is ANN's worst case


def test_filtered_search_on_an_ann_table_finds_a_rare_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 rows of a rare group sit in one cluster; the query is at the cluster farthest from it. IVF probes
    the partitions nearest the query, which hold no rare row: the filtered search must still return k."""
    rng = np.random.default_rng(5)
    n, dim = 12_800, 16  # 50 IVF partitions
    centers = 4.0 * rng.standard_normal((100, dim))  # [100, D]
    labels = rng.integers(0, 100, n)
    vectors = (centers[labels] + rng.standard_normal((n, dim))).astype(np.float32)  # [n, D]
    group = np.full(n, "common", dtype=object)
    rare = np.flatnonzero(labels == 0)[:30]
    group[rare] = "rare"
    meta = CatalogMeta("synthetic", "r0", "p0", "cls", None, None, "crop", False, dim, "float32")
    options = IndexOptions("cosine", ann_threshold=MIN_ANN_ROWS)
    ids = [str(i) for i in range(n)]
    create_table(tmp_path / "db", "t", ids, vectors, meta, extra={"group": list(group)}, options=options)
    index = SimilarityIndex.open(tmp_path / "db", "t")
    assert index.has_ann()
    far = centers[int(np.argmin(brute_force(centers, centers[0], "cosine")))].astype(np.float32)  # [D]
    where = "group = 'rare'"
    reference = brute_force(vectors[rare], far, "cosine")  # [30]
    order = np.argsort(-reference, kind="stable")[:10]
    # what a plain IVF query returns: the probed partitions hold too few rare rows
    assert len(index._query(index.check_vector(far), 10, where, 1)) < 10

    hits = index.search(far, 10, where)  # 30 matching rows: searched exactly
    assert [h.id for h in hits] == [str(rare[i]) for i in order]
    np.testing.assert_allclose([h.score for h in hits], reference[order], atol=TOL)
    assert "ANNSubIndex" not in index.explain(far, 10, where)
    # a filter selecting more rows than EXACT_FILTER_ROWS goes through IVF; an answer short of k is redone
    monkeypatch.setattr(search_module, "EXACT_FILTER_ROWS", 0)
    assert "ANNSubIndex" in index.explain(far, 10, where, nprobes=1)
    assert index.search(far, 10, where, nprobes=1) == hits
    assert index.search(far, 10, "group = 'none'") == []


def test_build_streams_shards_and_refuses_duplicate_ids_before_writing(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    vectors = rng.standard_normal((30, 8)).astype(np.float32)
    meta = CatalogMeta("synthetic", "r0", "p0", "cls", None, None, "crop", False, 8, "float32")
    folder = tmp_path / "cat"
    folder.mkdir()
    for shard in range(3):
        rows = slice(10 * shard, 10 * shard + 10)
        ids = [f"i{i}" for i in range(30)][rows]
        write_shard(folder, shard, build_table(ids, vectors[rows], {"brand": [f"b{shard}"] * 10}, meta))
    report = build_index(folder, tmp_path / "db", "t")
    assert (report.rows, report.inserted) == (30, 30)
    index = SimilarityIndex.open(tmp_path / "db", "t")
    for row in (0, 15, 29):
        hit = index.search(vectors[row], 1)[0]
        assert (hit.id, hit.metadata) == (f"i{row}", {"brand": f"b{row // 10}"})
    assert add_catalog(folder, tmp_path / "db", "t").updated == 30
    write_shard(folder, 3, build_table(["i3"], vectors[:1], {"brand": ["x"]}, meta))  # a duplicate id
    with pytest.raises(CatalogError, match="duplicate ids across its shards"):
        build_index(folder, tmp_path / "db", "t2")
    assert "t2" not in table_names(connect(tmp_path / "db"))  # refused before anything was written


def test_a_table_built_over_the_threshold_gets_its_index_at_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((300, 16)).astype(np.float32)
    meta = CatalogMeta("synthetic", "r0", "p0", "cls", None, None, "crop", False, 16, "float32")
    ids = [str(i) for i in range(300)]
    report = create_table(
        tmp_path / "db", "t", ids, vectors, meta, options=IndexOptions("dot", ann_threshold=300)
    )
    assert (report.ann, report.ann_built) == (True, True)
    table = open_table(tmp_path / "db", "t")
    assert table.index_stats(table.list_indices()[0].name).distance_type == "dot"
    hits = SimilarityIndex.open(tmp_path / "db", "t").search(vectors[17], k=3)
    reference = brute_force(vectors, vectors[17], "dot")  # [300]
    # refined ANN scores are the exact inner products of the rows returned (float32: ~1e-6 relative)
    np.testing.assert_allclose(
        [h.score for h in hits], [reference[int(h.id)] for h in hits], rtol=1e-6, atol=TOL
    )
    assert hits[0].id == str(int(np.argmax(reference)))


def test_delete_needs_ids_or_where_and_missing_tables_are_named(
    catalogs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_index(catalogs["first"], tmp_path / "db", "t")
    capsys.readouterr()
    assert main(["index", "delete", "--db", str(tmp_path / "db"), "--table", "t"]) == 2
    assert "give either ids or a --where predicate" in capsys.readouterr().err
    assert main(["index", "delete", "--db", str(tmp_path / "db"), "--table", "nope", "x"]) == 2
    assert capsys.readouterr().err == (
        f"vitembed index: error: table 'nope' is not in {tmp_path / 'db'} (tables: t)\n"
    )
    assert (
        main(["index", "delete", "--db", str(tmp_path / "db"), "--table", "t", "--where", "brnd = 'x'"]) == 2
    )
    assert "invalid where filter" in capsys.readouterr().err


def test_a_table_not_built_by_vitembed_is_refused(tmp_path: Path) -> None:
    import lancedb
    import pyarrow as pa

    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(8, np.float32)), 4)  # [2][4]
    lancedb.connect(str(tmp_path / "db")).create_table(
        "plain", pa.table({"id": ["a", "b"], "vector": vectors})
    )
    with pytest.raises(IndexStoreError) as caught:
        SimilarityIndex.open(tmp_path / "db", "plain")
    assert str(caught.value) == (
        f"table 'plain' in {tmp_path / 'db'} has no vitembed metadata: "
        "it was not built by `vitembed index build`"
    )
