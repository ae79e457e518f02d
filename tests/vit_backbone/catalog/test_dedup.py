"""Near-duplicate groups: blocked pairs equal the full matrix, components are the known groups, the CLI
writes the Parquet and summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from vitembed.cli.main import main

from vit_backbone.catalog.dedup import above_threshold_pairs
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shards import build_table, write_shard


def _write_catalog(folder: Path, ids: list[str], vectors: np.ndarray) -> None:
    meta = CatalogMeta("synthetic", "r0", "p0", "mean", [8], None, "pad", False, vectors.shape[1], "float32")
    half = len(ids) // 2
    folder.mkdir(parents=True)
    write_shard(folder, 0, build_table(ids[:half], vectors[:half], {}, meta))
    write_shard(folder, 1, build_table(ids[half:], vectors[half:], {}, meta))


def _pairwise(groups: dict[str, int]) -> set[frozenset[str]]:
    by_group: dict[int, list[str]] = {}
    for item, group in groups.items():
        by_group.setdefault(group, []).append(item)
    return {frozenset((a, b)) for m in by_group.values() for a in m for b in m if a < b}


def test_blocked_pairs_equal_the_full_matrix() -> None:
    x = np.random.default_rng(0).normal(size=(301, 16)).astype(np.float32)
    x[150] = x[3] + 0.01  # a planted pair across blocks
    i, j, s = above_threshold_pairs(x, 0.6, block=64)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    full = xn @ xn.T
    want = {(a, b) for a, b in zip(*np.nonzero(full >= 0.6), strict=True) if a < b}
    assert set(zip(i.tolist(), j.tolist(), strict=True)) == want and (3, 150) in want
    np.testing.assert_allclose(s, full[i, j], atol=1e-6)


def test_cli_finds_the_planted_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    base = rng.normal(size=(40, 32)).astype(np.float32)  # 40 unrelated items
    ids = [f"item{k:02d}" for k in range(40)]
    vectors = [base]
    truth = {}
    for group, source in enumerate((3, 17, 31)):  # three groups: the source and two noisy copies each
        truth[ids[source]] = group
        for copy in range(2):
            ids.append(f"copy{group}-{copy}")
            vectors.append(base[source] + 0.05 * rng.normal(size=(1, 32)).astype(np.float32))
            truth[ids[-1]] = group
    _write_catalog(tmp_path / "cat", ids, np.concatenate(vectors))
    out = tmp_path / "dups.parquet"
    assert (
        main(["dedup", str(tmp_path / "cat"), "--out", str(out), "--threshold", "0.9", "--block", "7"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    table = pq.read_table(out).to_pydict()
    assert list(table) == ["group", "id", "similarity_to_representative"]
    found = dict(zip(table["id"], table["group"], strict=True))
    assert _pairwise(found) == _pairwise(truth)
    assert summary["groups"] == 3 and summary["rows_in_groups"] == 9 and summary["duplicates_to_drop"] == 6
    assert json.loads((tmp_path / "dups.parquet.summary.json").read_text())["groups"] == 3
    sims = np.asarray(table["similarity_to_representative"])
    assert (sims > 0.9).all() and np.isclose(sims, 1.0, atol=1e-6).sum() == 3  # one representative each
