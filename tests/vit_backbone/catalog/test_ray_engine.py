"""``embed-catalog --engine ray`` on a real local Ray cluster (2 CPUs, no GPU, started once per session):
the same ids, failures, metadata and vectors (≤ 1e-5) as the local engine, resume after a lost shard, and
a clear error naming the extra when Ray is not installed."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from catalog_images import ImageTree

from vit_backbone import Backbone
from vit_backbone.catalog.error_log import read_failures
from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.job_folder import EmbedSpec, resolve_meta
from vit_backbone.catalog.meta import META_KEY, CatalogMeta
from vit_backbone.catalog.ray_engine import DecodeStage, Embedder, _one_line_error
from vit_backbone.catalog.shards import read_catalog, shard_paths

if TYPE_CHECKING:
    from conftest import RunCli  # tests/catalog/conftest.py (typing only: 'conftest' is ambiguous at runtime)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_engine_agrees_with_local(
    ray_cluster: Any, tree: ImageTree, run_cli: RunCli, tmp_path: Path
) -> None:
    flags = ("--shard-size", "5", "--batch-size", "4", "--pooling", "mean", "--policy", "dynamic")
    local = run_cli(tree.root, tmp_path / "local", *flags)
    assert local.code == 0, local.err
    context = ray_cluster.data.DataContext.get_current()
    context.execution_options.preserve_order = False
    remote = run_cli(
        tree.root, tmp_path / "ray", *flags, "--engine", "ray", "--actors", "1", "--workers", "1"
    )
    assert remote.code == 0, remote.err
    assert context.execution_options.preserve_order is False  # the job restores what it changed
    assert remote.out.startswith(
        f"done: {len(tree.good)} rows written, {len(tree.bad)} errors, 0 already done"
    )
    a, b = read_catalog(tmp_path / "local"), read_catalog(tmp_path / "ray")
    assert b.ids == a.ids == tree.good
    assert b.meta == a.meta
    np.testing.assert_allclose(b.embeddings, a.embeddings, rtol=0, atol=1e-5)
    assert read_failures(tmp_path / "ray") == read_failures(tmp_path / "local")
    local_shards, ray_shards = shard_paths(tmp_path / "local"), shard_paths(tmp_path / "ray")
    assert [p.name for p in ray_shards] == [p.name for p in local_shards]
    for x, y in zip(local_shards, ray_shards, strict=True):
        assert pq.read_schema(y).equals(pq.read_schema(x), check_metadata=True)
        assert pq.read_schema(y).metadata[META_KEY] == pq.read_schema(x).metadata[META_KEY]

    # lose the last shard (as if the job died before committing it): a rerun redoes exactly those rows
    ray_shards[-1].unlink()
    again = run_cli(tree.root, tmp_path / "ray", *flags, "--engine", "ray")
    assert again.code == 0, again.err
    assert again.out.startswith("done: 2 rows written, 0 errors, 14 already done")
    resumed = read_catalog(tmp_path / "ray")
    assert resumed.ids == a.ids
    np.testing.assert_allclose(resumed.embeddings, a.embeddings, rtol=0, atol=1e-5)


def test_ray_engine_decides_auto_precision_on_a_worker_and_records_it(
    ray_cluster: Any, tree: ImageTree, run_cli: RunCli, tmp_path: Path
) -> None:
    from vit_backbone.precision import cpu_has_native_bf16

    few = tmp_path / "few"
    few.mkdir()
    for name in tree.good[:3]:
        (few / Path(name).name).write_bytes((tree.root / name).read_bytes())
    result = run_cli(few, tmp_path / "out", "--engine", "ray", "--actors", "1", "--precision", "auto")
    assert result.code == 0, result.err
    # the worker runs on this CPU here: bfloat16 only where it is native, and only if the speed check keeps it
    allowed = {"float32", "bfloat16"} if cpu_has_native_bf16() else {"float32"}
    decided = re.search(r"embed-catalog: --precision auto -> (\w+), decided on a Ray worker", result.err)
    assert decided is not None, result.err
    expected = decided.group(1)
    assert expected in allowed
    catalog = read_catalog(tmp_path / "out")
    assert catalog.meta.precision == expected and len(catalog.ids) == 3
    job = json.loads((tmp_path / "out" / "catalog.json").read_text())["job"]
    assert (job["precision"], job["precision_used"]) == ("auto", expected)
    again = run_cli(few, tmp_path / "out", "--engine", "ray", "--precision", "auto")  # resumed: stored choice
    assert again.code == 0 and "decided on a Ray worker" not in again.err


def _meta(backbone: Backbone) -> CatalogMeta:
    return resolve_meta(backbone, "tiny", EmbedSpec())


def test_actor_refuses_another_revision_in_one_line(tiny_path: Path, tiny: Backbone) -> None:
    """What a worker node with another checkpoint at the same path reports (the driver prints it as is)."""
    meta = dataclasses.replace(_meta(tiny), revision="rev-elsewhere")
    with pytest.raises(CatalogError) as caught:
        Embedder(str(tiny_path), "float32", meta, "cpu")
    assert str(caught.value) == (
        f"the Ray workers resolve {str(tiny_path)!r} to revision {tiny.checkpoint.revision}, the driver to "
        "rev-elsewhere: give every node the same checkpoint"
    )
    wrapped = RuntimeError("ray.exceptions.RayTaskError: ...\nTraceback (most recent call last): ...")
    wrapped.__cause__ = caught.value
    unwrapped = _one_line_error(wrapped)
    assert isinstance(unwrapped, CatalogError) and str(unwrapped) == str(caught.value)
    assert _one_line_error(RuntimeError("not ours")) is None


def test_actor_turns_a_failing_forward_into_an_error_row(
    tree: ImageTree, tiny_path: Path, tiny: Backbone, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = _meta(tiny)
    ids = ["a/b/c/x.png", "a/cat.jpg", "broken/empty.jpg", "c/two.png"]
    decode = DecodeStage(tiny.preprocess_config, tiny.patch_size, tiny.processing_grid, meta)
    rows = {
        "row": np.arange(4),
        "id": np.array(ids),
        "path": np.array([str(tree.root / i) for i in ids]),
        "invalid": np.array(["", "", "", ""]),
    }
    decoded = {k: np.array(v, dtype=object) for k, v in decode(rows).items()}
    real = Backbone.embed_prepared
    poison = tiny.preprocessor((tree.root / ids[0]).read_bytes(), policy="crop", draft=True).pixel_values

    def embed_prepared(self: Backbone, prepared: list[Any], **options: Any) -> np.ndarray:
        if any(torch.equal(p.pixel_values, poison) for p in prepared):  # a/b/c/x.png
            raise RuntimeError("boom")
        return real(self, prepared, **options)

    monkeypatch.setattr(Backbone, "embed_prepared", embed_prepared)
    table = Embedder(str(tiny_path), "float32", meta, "cpu")(decoded)
    assert table.column("code").to_pylist() == ["internal_error", "", "empty", ""]
    assert table.column("message").to_pylist()[0] == "the forward pass failed: RuntimeError: boom"
    vectors = table.column("embedding").combine_chunks().flatten().to_numpy().reshape(4, -1)  # [4, D]
    monkeypatch.setattr(Backbone, "embed_prepared", real)
    expected = tiny.embed([(tree.root / i).read_bytes() for i in ("a/cat.jpg", "c/two.png")])
    np.testing.assert_allclose(vectors[[1, 3]], expected, rtol=0, atol=1e-5)


def test_missing_ray_names_the_extra(
    tree: ImageTree, run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = run_cli(tree.root, tmp_path / "out", "--engine", "ray")
    assert result.code == 2
    assert result.err == (
        "vitembed embed-catalog: error: embed-catalog --engine ray needs an optional dependency: "
        "pip install -e '.[ray]' (from a clone of vitembed)\n"
    )
    assert not (tmp_path / "out").exists()
