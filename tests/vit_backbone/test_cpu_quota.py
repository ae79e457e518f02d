"""available_cpus / cgroup_cpu_limit on fake cgroup trees (v2 cpu.max, v1 cfs files, none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vit_backbone.cpu_quota import available_cpus, cgroup_cpu_limit


def _v2(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text + "\n")
    return root


def _v1(root: Path, quota: str, period: str, folder: str = "cpu,cpuacct") -> Path:
    (root / folder).mkdir(parents=True)
    (root / folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    (root / folder / "cpu.cfs_period_us").write_text(period + "\n")
    return root


@pytest.mark.parametrize(
    ("text", "limit"),
    [("100000 100000", 1.0), ("150000 100000", 1.5), ("50000 100000", 0.5), ("max 100000", None), ("", None)],
)
def test_cgroup_v2_quota(tmp_path: Path, text: str, limit: float | None) -> None:
    assert cgroup_cpu_limit(_v2(tmp_path, text)) == limit


def test_cgroup_v1_quota_and_unlimited(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(_v1(tmp_path / "a", "200000", "100000")) == 2.0
    assert cgroup_cpu_limit(_v1(tmp_path / "b", "-1", "100000", folder="cpu")) is None
    assert cgroup_cpu_limit(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("text", "affinity", "expected"),
    [
        ("100000 100000", {0, 1, 2, 3}, 1),  # --cpus 1 on a 4-core host
        ("150000 100000", {0, 1, 2, 3}, 1),  # a fractional core is not worth a thread
        ("250000 100000", {0, 1, 2, 3}, 2),
        ("50000 100000", {0, 1}, 1),  # never below one thread
        ("800000 100000", {0, 1}, 2),  # the affinity mask caps a generous quota
        ("max 100000", {0, 1, 2}, 3),
    ],
)
def test_available_cpus(tmp_path: Path, text: str, affinity: set[int], expected: int) -> None:
    assert available_cpus(_v2(tmp_path, text), affinity=affinity) == expected


def test_available_cpus_without_affinity_uses_cpu_count(tmp_path: Path) -> None:
    assert available_cpus(tmp_path / "none", affinity=set(), cpu_count=6) == 6
    assert available_cpus(_v1(tmp_path / "v1", "300000", "100000"), affinity=set(), cpu_count=6) == 3
