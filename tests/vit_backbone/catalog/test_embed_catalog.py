"""``vitembed embed-catalog`` with the local engine on a generated image tree: the exact ids and row count,
the failures and their codes, the vectors equal to the library's for the same file and options, every
shard's metadata, float16 storage, resuming a finished catalog, and refusing a rerun with other options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from catalog_images import ImageTree

from vit_backbone import Backbone
from vit_backbone.catalog.error_log import read_failures
from vit_backbone.catalog.meta import META_KEY, CatalogMeta
from vit_backbone.catalog.shards import read_catalog, shard_paths

if TYPE_CHECKING:
    from conftest import RunCli  # tests/catalog/conftest.py (typing only: 'conftest' is ambiguous at runtime)

TOL = 1e-5


def library_vectors(backbone: Backbone, tree: ImageTree, ids: list[str], **options: object) -> np.ndarray:
    """What ``Backbone.embed`` gives for the same files' bytes (one call per image: no batching effects)."""
    rows = [backbone.embed([(tree.root / i).read_bytes()], **options)[0] for i in ids]  # type: ignore[arg-type]
    return np.stack(rows)  # [N, D]


def test_folder_catalog(tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "cat"
    result = run_cli(tree.root, out, "--shard-size", "5", "--batch-size", "4")
    assert result.code == 0, result.err
    assert (
        result.out.strip()
        .splitlines()[-1]
        .startswith(f"done: {len(tree.good)} rows written, {len(tree.bad)} errors, 0 already done;")
    )
    catalog = read_catalog(out)
    assert catalog.ids == tree.good  # sorted POSIX relative paths, non-images and broken files excluded
    assert catalog.embeddings.shape == (12, 32)
    assert catalog.extra == {}
    # 12 rows in shards of 5: 5 + 5 + 2, numbered from 0
    paths = shard_paths(out)
    assert [p.name for p in paths] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [pq.read_metadata(p).num_rows for p in paths] == [5, 5, 2]
    assert not list(out.glob("*.tmp"))
    expected = CatalogMeta(
        model=tiny.checkpoint.path.name,
        revision=tiny.checkpoint.revision,
        preprocess_hash=tiny.preprocess_config.hash(),
        pooling="cls",
        layers=None,
        size=None,
        policy="crop",
        normalized=False,
        dim=32,
        dtype="float32",
        precision="float32",
        preset="default-v3",
    )
    for path in paths:
        schema = pq.read_schema(path)
        assert CatalogMeta.from_json(schema.metadata[META_KEY]) == expected
        assert schema.field("id").type == pa.string()
        assert schema.field("embedding").type == pa.list_(pa.float32(), 32)
    assert catalog.meta == expected
    job_file = json.loads((out / "catalog.json").read_text())
    assert CatalogMeta.from_dict(job_file) == expected
    assert job_file["job"]["source"] == str(tree.root) and job_file["job"]["precision_used"] == "float32"
    failures = read_failures(out)
    assert {f.id: f.code for f in failures} == tree.bad
    assert all(f.path == str(tree.root / f.id) and f.message for f in failures)
    np.testing.assert_allclose(catalog.embeddings, library_vectors(tiny, tree, catalog.ids), rtol=0, atol=TOL)


def test_options_reach_the_vectors(tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path) -> None:
    """Dynamic policy (images of several grids in one batch), mean pooling of block 0, normalised."""
    out = tmp_path / "cat"
    flags = ("--pooling", "mean", "--layers", "0", "--policy", "dynamic", "--size", "56x84", "--normalize")
    result = run_cli(tree.root, out, *flags, "--batch-size", "5")
    assert result.code == 0, result.err
    catalog = read_catalog(out)
    assert catalog.meta.pooling == "mean" and catalog.meta.layers == [0] and catalog.meta.size == [56, 84]
    assert catalog.meta.policy == "dynamic" and catalog.meta.normalized
    expected = library_vectors(
        tiny, tree, catalog.ids, pooling="mean", layers=[0], policy="dynamic", size=(56, 84), normalize=True
    )
    np.testing.assert_allclose(catalog.embeddings, expected, rtol=0, atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(catalog.embeddings, axis=1), 1.0, atol=1e-6)


def test_float16_storage(tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "cat16"
    assert run_cli(tree.root, out, "--dtype", "float16").code == 0
    schema = pq.read_schema(shard_paths(out)[0])
    assert schema.field("embedding").type == pa.list_(pa.float16(), 32)
    catalog = read_catalog(out)
    assert catalog.meta.dtype == "float16" and catalog.embeddings.dtype == np.float32
    expected = library_vectors(tiny, tree, catalog.ids).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(catalog.embeddings, expected, rtol=0, atol=2e-3)


def test_rerun_resumes_and_other_options_are_refused(
    tree: ImageTree, run_cli: RunCli, tmp_path: Path
) -> None:
    out = tmp_path / "cat"
    assert run_cli(tree.root, out, "--shard-size", "4").code == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = run_cli(tree.root, out, "--shard-size", "4", "--batch-size", "3", "--workers", "1")
    assert again.code == 0, again.err
    assert again.out.strip().startswith(
        "done: 0 rows written, 0 errors, 16 already done; catalog holds 12 rows"
    )
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    refused = run_cli(tree.root, out, "--pooling", "mean", "--dtype", "float16")
    assert refused.code == 2
    assert refused.err.startswith(
        f"vitembed embed-catalog: error: {out} holds a catalog made with other options"
    )
    assert "pooling: cls != mean" in refused.err and "dtype: float32 != float16" in refused.err
    assert "rerun with the same arguments to resume it, or write to a new --out folder" in refused.err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert len(read_failures(out)) == len(tree.bad)


def test_patch_pooling_and_bad_size_are_refused_before_any_work(
    tree: ImageTree, run_cli: RunCli, tmp_path: Path
) -> None:
    patch = run_cli(tree.root, tmp_path / "a", "--pooling", "patch")
    assert patch.code == 2 and "invalid choice: 'patch'" in patch.err
    size = run_cli(tree.root, tmp_path / "b", "--policy", "squash", "--size", "50", "60")
    assert size.code == 2
    assert "not a multiple of the 14x14 patch" in size.err and "nearest multiples of 14: 42 or 56" in size.err
    assert not (tmp_path / "b").exists()
    ray_flag = run_cli(tree.root, tmp_path / "c", "--ray-address", "auto")
    assert ray_flag.code == 2 and "--ray-address and --actors need --engine ray" in ray_flag.err
    half = run_cli(tree.root, tmp_path / "d", "--precision", "float16")
    assert half.code == 2 and "precision 'float16' needs a CUDA device" in half.err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_manifest_sources(
    kind: str, tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path
) -> None:
    """Manifest order is kept, relative paths resolve against the manifest's folder, extra columns travel
    into the shards as strings, and a listed file that does not exist is a read_error."""
    chosen = tree.good[::2]
    rows = [
        {"id": f"sku-{n:03d}", "path": str(tree.root / rel), "label": f"class {n % 3}", "price": n * 1.5}
        for n, rel in enumerate(reversed(chosen))
    ]
    # one path relative to the manifest's folder, one missing file, one broken image
    rows[0]["path"] = str((tree.root / chosen[-1]).relative_to(tree.root.parent))
    rows.append({"id": "sku-missing", "path": "no/such/file.jpg", "label": "x", "price": 0})
    rows.append(
        {"id": "sku-broken", "path": str(tree.root / "broken/truncated.jpg"), "label": "y", "price": 1}
    )
    manifest = tree.root.parent / f"manifest-{kind}.{kind}"
    if kind == "csv":
        lines = ["id,path,label,price", *(f"{r['id']},{r['path']},{r['label']},{r['price']}" for r in rows)]
        manifest.write_text("\n".join(lines) + "\n")
    elif kind == "jsonl":
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), manifest)
    out = tmp_path / kind
    result = run_cli(manifest, out, "--shard-size", "2")
    assert result.code == 0, result.err
    catalog = read_catalog(out)
    good_rows = rows[:-2]
    assert catalog.ids == [r["id"] for r in good_rows]
    assert catalog.extra == {
        "label": [r["label"] for r in good_rows],
        "price": [json.dumps(r["price"]) if kind != "csv" else str(r["price"]) for r in good_rows],
    }
    assert pq.read_schema(shard_paths(out)[0]).field("label").type == pa.string()
    failures = {f.id: f.code for f in read_failures(out)}
    assert failures == {"sku-missing": "read_error", "sku-broken": "truncated"}
    expected = library_vectors(tiny, tree, list(reversed(chosen)))
    np.testing.assert_allclose(catalog.embeddings, expected, rtol=0, atol=TOL)


def test_manifest_problems_are_clear_errors(tree: ImageTree, run_cli: RunCli, tmp_path: Path) -> None:
    dup = tmp_path / "dup.csv"
    dup.write_text(f"id,path\na,{tree.root / tree.good[0]}\nb,{tree.root / tree.good[1]}\na,x.jpg\n")
    result = run_cli(dup, tmp_path / "out")
    assert result.code == 2
    assert result.err == (
        f"vitembed embed-catalog: error: manifest {dup} has 1 duplicate id(s): 'a'; ids must be unique (they "
        "are the catalog's keys, and a resumed job skips ids already done)\n"
    )
    assert not (tmp_path / "out").exists()
    no_path = tmp_path / "nopath.jsonl"
    no_path.write_text('{"id": "a", "file": "x.jpg"}\n')
    result = run_cli(no_path, tmp_path / "out")
    assert result.code == 2 and "lacks the column(s) path; it has ['id', 'file']" in result.err
    other = tmp_path / "list.txt"
    other.write_text("x.jpg\n")
    result = run_cli(other, tmp_path / "out")
    assert result.code == 2 and "is neither a folder nor a manifest" in result.err
