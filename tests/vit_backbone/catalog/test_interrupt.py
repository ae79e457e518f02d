"""Interrupting a real ``vitembed embed-catalog`` process and running it again.

The job gets enough work to be caught mid-run without any hook in the library: the 12 generated images
and a truncated one, then ``SLOW_ROWS`` rows of an 800x800 PNG (≈ 10 ms to decode each), committed two
rows per shard. The test polls for the first committed shard, signals the process at once, and checks
that the final shard was not written yet (so the job really was interrupted). Whatever was committed
must be a gap-free prefix of the source; a rerun with the same arguments must then hold every id exactly
once, with the vectors of the library (≤ 1e-5), and no temporary file left over.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from catalog_images import ImageTree, encode, picture

from vit_backbone import Backbone
from vit_backbone.catalog.error_log import read_failures
from vit_backbone.catalog.shards import read_catalog, shard_paths

if TYPE_CHECKING:
    from conftest import RunCli  # tests/catalog/conftest.py (typing only: 'conftest' is ambiguous at runtime)

ROOT = Path(__file__).resolve().parents[3]
SHARD = 2
SLOW_ROWS = 120
WAIT_S = 90.0
FLAGS = ("--shard-size", str(SHARD), "--batch-size", "2")


class Job:
    def __init__(self, tree: ImageTree, folder: Path) -> None:
        folder.mkdir()
        slow = folder / "slow.png"
        slow.write_bytes(encode(picture(4242, 800, 800), "PNG"))
        rows = [(f"img-{n:02d}", str(tree.root / rel)) for n, rel in enumerate(tree.good)]
        rows.insert(4, ("bad-truncated", str(tree.root / "broken/truncated.jpg")))
        rows += [(f"slow-{k:03d}", str(slow)) for k in range(SLOW_ROWS)]
        self.manifest = folder / "manifest.csv"
        self.manifest.write_text("id,path\n" + "".join(f"{i},{p}\n" for i, p in rows))
        self.ids = [i for i, _ in rows]
        self.paths = dict(rows)
        self.rows = [i for i in self.ids if i != "bad-truncated"]  # what the catalog ends up holding
        self.last_shard = (len(self.rows) + SHARD - 1) // SHARD - 1

    def start(self, out: Path, model: Path) -> subprocess.Popen[str]:
        argv = [
            sys.executable,
            "-m",
            "vitembed",
            "embed-catalog",
            str(self.manifest),
            "--out",
            str(out),
        ]
        argv += ["--model", str(model), "--precision", "float32", *FLAGS]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def expected(self, backbone: Backbone, ids: list[str]) -> np.ndarray:
        cache: dict[str, np.ndarray] = {}
        for i in ids:
            path = self.paths[i]
            if path not in cache:
                cache[path] = backbone.embed([Path(path).read_bytes()])[0]
        return np.stack([cache[self.paths[i]] for i in ids])  # [N, D]


def interrupt_after_first_shard(proc: subprocess.Popen[str], out: Path, job: Job, *signums: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not (out / "part-00000.parquet").exists():
        if proc.poll() is not None:
            pytest.fail(f"the job ended early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no shard within {WAIT_S} s: {proc.communicate()[1]}")
        time.sleep(0.005)
    for n, signum in enumerate(signums):
        if n:
            time.sleep(0.02)
        proc.send_signal(signum)
    assert not (out / f"part-{job.last_shard:05d}.parquet").exists(), "the job finished before the signal"


def check_prefix(out: Path, job: Job, *, whole_shards: bool = True) -> int:
    """The committed rows are the first rows of the source, no gaps; after kill -9 only whole shards (a
    stop signal also commits the rows of a last, partial shard); returns how many."""
    committed = read_catalog(out).ids
    assert len(committed) >= SHARD and (len(committed) % SHARD == 0 or not whole_shards)
    assert committed == job.rows[: len(committed)]
    failures = [f.id for f in read_failures(out)]
    assert failures == (["bad-truncated"] if len(committed) >= 6 else failures[:1])  # met before row 6
    assert set(failures) <= {"bad-truncated"}
    return len(committed)


def finish_and_check(run_cli: RunCli, job: Job, out: Path, backbone: Backbone, committed: int) -> None:
    failed = len(read_failures(out))
    result = run_cli(job.manifest, out, *FLAGS)
    assert result.code == 0, result.err
    assert f"({committed + failed} already done)" in result.err
    rows, errors = len(job.rows) - committed, 1 - failed
    assert result.out.startswith(
        f"done: {rows} rows written, {errors} errors, {committed + failed} already done"
    )
    catalog = read_catalog(out)
    assert catalog.ids == job.rows  # each id exactly once, in source order
    assert [f.id for f in read_failures(out)] == ["bad-truncated"]
    assert not list(out.glob("*.tmp"))
    np.testing.assert_allclose(catalog.embeddings, job.expected(backbone, catalog.ids), rtol=0, atol=1e-5)


def test_kill_9_then_rerun_resumes(
    tree: ImageTree, tiny_path: Path, tiny: Backbone, run_cli: RunCli, tmp_path: Path
) -> None:
    job = Job(tree, tmp_path / "src")
    out = tmp_path / "cat"
    proc = job.start(out, tiny_path)
    interrupt_after_first_shard(proc, out, job, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    committed = check_prefix(out, job)
    # a kill during a shard write leaves its temporary file: the rerun must delete it, not mistake it
    leftover = out / f"part-{len(shard_paths(out)):05d}.parquet.tmp"
    leftover.write_bytes(b"PAR1 half a shard")
    finish_and_check(run_cli, job, out, tiny, committed)


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_commits_what_is_done_and_exits(
    signum: int,
    status: int,
    tree: ImageTree,
    tiny_path: Path,
    tiny: Backbone,
    run_cli: RunCli,
    tmp_path: Path,
) -> None:
    job = Job(tree, tmp_path / "src")
    out = tmp_path / "cat"
    proc = job.start(out, tiny_path)
    interrupt_after_first_shard(proc, out, job, signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == status, stderr
    assert "stopping: committing the rows embedded so far" in stderr and "Traceback" not in stderr
    n = check_prefix(out, job, whole_shards=False)
    failed = len(read_failures(out))
    assert stdout.startswith(
        f"interrupted: {n} rows written, {failed} errors, 0 already done; catalog holds {n}"
    )
    assert not list(out.glob("*.tmp"))
    finish_and_check(run_cli, job, out, tiny, n)


def test_second_ctrl_c_aborts_without_a_traceback(
    tree: ImageTree, tiny_path: Path, tiny: Backbone, run_cli: RunCli, tmp_path: Path
) -> None:
    job = Job(tree, tmp_path / "src")
    out = tmp_path / "cat"
    proc = job.start(out, tiny_path)
    interrupt_after_first_shard(proc, out, job, signal.SIGINT, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    # the second Ctrl-C either aborted the commit, or came after it (then it is ignored: nothing to abort)
    aborted = "\naborted: rows in committed shards and errors.jsonl are kept" in stderr
    assert aborted or stdout.startswith("interrupted: "), (stdout, stderr)
    n = check_prefix(out, job, whole_shards=False)
    finish_and_check(run_cli, job, out, tiny, n)
