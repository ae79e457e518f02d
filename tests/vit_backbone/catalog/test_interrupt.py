"""Interrupting a real ``vitembed embed-catalog`` process and running it again.

The job (the 12 generated images, a truncated one, then ``MORE_ROWS`` rows of an 800x800 PNG, two rows per
shard) runs through ``paused_job.py``: the real command, which after committing its first shard tells the
test so through a pipe and waits on a second pipe. The test sends the real signal (SIGKILL, SIGINT,
SIGTERM) only then, and opens the gate only after the signal: the job is caught mid-run by construction,
and exactly the first shard is committed when the signal is handled. Whatever was committed must be a
gap-free prefix of the source; a rerun with the same arguments must then hold every id exactly once, with
the vectors of the library (≤ 1e-5), and no temporary file left over.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
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
PAUSED_JOB = Path(__file__).with_name("paused_job.py")
SHARD = 2
MORE_ROWS = 8
WAIT_S = 120.0  # for the first shard of a fresh process (imports, model load); a bound, not an ordering
FLAGS = ("--shard-size", str(SHARD), "--batch-size", "2")


class Job:
    def __init__(self, tree: ImageTree, folder: Path) -> None:
        folder.mkdir()
        slow = folder / "slow.png"
        slow.write_bytes(encode(picture(4242, 800, 800), "PNG"))
        rows = [(f"img-{n:02d}", str(tree.root / rel)) for n, rel in enumerate(tree.good)]
        rows.insert(4, ("bad-truncated", str(tree.root / "broken/truncated.jpg")))
        rows += [(f"slow-{k:03d}", str(slow)) for k in range(MORE_ROWS)]
        self.manifest = folder / "manifest.csv"
        self.manifest.write_text("id,path\n" + "".join(f"{i},{p}\n" for i, p in rows))
        self.ids = [i for i, _ in rows]
        self.paths = dict(rows)
        self.rows = [i for i in self.ids if i != "bad-truncated"]  # what the catalog ends up holding
        self.last_shard = (len(self.rows) + SHARD - 1) // SHARD - 1

    def start(self, out: Path, model: Path) -> PausedJob:
        return PausedJob(self, out, model)

    def expected(self, backbone: Backbone, ids: list[str]) -> np.ndarray:
        cache: dict[str, np.ndarray] = {}
        for i in ids:
            path = self.paths[i]
            if path not in cache:
                cache[path] = backbone.embed([Path(path).read_bytes()])[0]
        return np.stack([cache[self.paths[i]] for i in ids])  # [N, D]


class PausedJob:
    """The job in its own process, paused right after committing its first shard (see paused_job.py)."""

    def __init__(self, job: Job, out: Path, model: Path) -> None:
        self.job = job
        self.ready, ready_w = os.pipe()
        gate_r, self.gate = os.pipe()
        argv = [sys.executable, str(PAUSED_JOB), str(ready_w), str(gate_r), "embed-catalog"]
        argv += [
            str(job.manifest),
            "--out",
            str(out),
            "--model",
            str(model),
            "--precision",
            "float32",
            *FLAGS,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(ready_w, gate_r),
        )
        os.close(ready_w)  # the child holds the only write end: its exit reads as end of file
        os.close(gate_r)

    def wait_first_shard(self) -> None:
        readable, _, _ = select.select([self.ready], [], [], WAIT_S)
        if not readable:
            self.proc.kill()
            pytest.fail(f"no shard within {WAIT_S} s: {self.proc.communicate()[1]}")
        if os.read(self.ready, 1) != b"1":
            pytest.fail(f"the job ended early ({self.proc.wait()}): {self.proc.communicate()[1]}")

    def signal_then_release(self, signum: int) -> None:
        """The signal is pending in the paused job before the gate opens."""
        self.proc.send_signal(signum)
        os.write(self.gate, b"1")

    def read_stderr_until(self, needle: str) -> str:
        """stderr up to the moment it holds ``needle`` (the job printed it: an event), read unbuffered so
        that ``communicate`` reads the rest."""
        assert self.proc.stderr is not None
        fd, seen = self.proc.stderr.fileno(), b""
        while needle.encode() not in seen:
            readable, _, _ = select.select([fd], [], [], WAIT_S)
            chunk = os.read(fd, 4096) if readable else b""
            if not chunk:
                self.proc.kill()
                pytest.fail(f"the job printed no {needle!r}: {seen.decode(errors='replace')}")
            seen += chunk
        return seen.decode()

    def communicate(self, before: str = "") -> tuple[str, str]:
        stdout, stderr = self.proc.communicate(timeout=WAIT_S)
        os.close(self.ready)
        os.close(self.gate)
        return stdout, before + stderr


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
    paused = job.start(out, tiny_path)
    paused.wait_first_shard()
    paused.proc.kill()
    paused.communicate()
    assert paused.proc.returncode == -signal.SIGKILL
    assert check_prefix(out, job) == SHARD  # killed while paused after the first shard
    # a kill during a shard write leaves its temporary file: the rerun must delete it, not mistake it
    leftover = out / f"part-{len(shard_paths(out)):05d}.parquet.tmp"
    leftover.write_bytes(b"PAR1 half a shard")
    finish_and_check(run_cli, job, out, tiny, SHARD)


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
    paused = job.start(out, tiny_path)
    paused.wait_first_shard()
    paused.signal_then_release(signum)
    stdout, stderr = paused.communicate()
    assert paused.proc.returncode == status, stderr
    assert "stopping: committing the rows embedded so far" in stderr and "Traceback" not in stderr
    # the handler ran before the job went on: nothing past the first shard was embedded or committed
    assert check_prefix(out, job, whole_shards=False) == SHARD
    assert read_failures(out) == []  # the truncated image (row 5) was never reached
    assert stdout.startswith(
        f"interrupted: {SHARD} rows written, 0 errors, 0 already done; catalog holds {SHARD}"
    )
    assert not list(out.glob("*.tmp"))
    finish_and_check(run_cli, job, out, tiny, SHARD)


def test_second_ctrl_c_aborts_without_a_traceback(
    tree: ImageTree, tiny_path: Path, tiny: Backbone, run_cli: RunCli, tmp_path: Path
) -> None:
    job = Job(tree, tmp_path / "src")
    out = tmp_path / "cat"
    paused = job.start(out, tiny_path)
    paused.wait_first_shard()
    paused.proc.send_signal(signal.SIGINT)  # the paused job handles it while it waits at the gate
    before = paused.read_stderr_until("(Ctrl-C again to abort now)")
    paused.signal_then_release(signal.SIGINT)  # still inside the first shard's commit: it aborts there
    stdout, stderr = paused.communicate(before)
    assert paused.proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "\naborted: rows in committed shards and errors.jsonl are kept" in stderr, stderr
    assert stdout == ""
    # the abort came right after the first shard's file was written: its rows count as committed, once
    assert check_prefix(out, job) == SHARD
    assert not list(out.glob("*.tmp"))
    finish_and_check(run_cli, job, out, tiny, SHARD)
