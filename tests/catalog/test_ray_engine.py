"""``embed-catalog --engine ray`` on a real local Ray cluster (2 CPUs, no GPU, started once per session):
the same ids, failures, metadata and vectors (≤ 1e-5) as the local engine, resume after a lost shard, and
a clear error naming the extra when Ray is not installed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from catalog_images import ImageTree
from conftest import RunCli

from catalog.error_log import read_failures
from catalog.meta import META_KEY
from catalog.shards import read_catalog, shard_paths


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
    remote = run_cli(tree.root, tmp_path / "ray", *flags, "--engine", "ray", "--actors", "1")
    assert remote.code == 0, remote.err
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


def test_missing_ray_names_the_extra(
    tree: ImageTree, run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = run_cli(tree.root, tmp_path / "out", "--engine", "ray")
    assert result.code == 2
    assert result.err == (
        "vitembed embed-catalog: error: embed-catalog --engine ray needs an optional dependency: "
        "pip install 'vitembed[ray]'\n"
    )
    assert not (tmp_path / "out").exists()
