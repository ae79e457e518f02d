"""Interrupting a real ``vitembed embed-catalog`` process and running it again.

To interrupt at a known point, the manifest lists a named pipe (FIFO) among the images: opening it for
reading blocks until a writer appears, so the job commits every shard before that item and then waits
there. The test kills it at that moment (``kill -9``, or SIGINT for the clean stop), replaces the pipe
with a real JPEG and reruns with the same arguments: every id must end up exactly once, with the vectors
of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from catalog_images import ImageTree, encode, picture
from conftest import RunCli

from catalog.error_log import read_failures
from catalog.shards import read_catalog, shard_paths

ROOT = Path(__file__).resolve().parents[2]
FIFO_AT = 10  # position of the pipe in the manifest
SHARD = 3
WAIT_S = 60.0


def make_manifest(tree: ImageTree, folder: Path) -> tuple[Path, Path, list[str]]:
    """12 good images, a truncated JPEG at position 4 and the pipe at FIFO_AT."""
    folder.mkdir()
    rows = [(f"img-{n:02d}", str(tree.root / rel)) for n, rel in enumerate(tree.good)]
    rows.insert(4, ("bad-truncated", str(tree.root / "broken/truncated.jpg")))
    fifo = folder / "late.jpg"
    os.mkfifo(fifo)
    rows.insert(FIFO_AT, ("late", str(fifo)))
    manifest = folder / "manifest.csv"
    manifest.write_text("id,path\n" + "".join(f"{i},{p}\n" for i, p in rows))
    return manifest, fifo, [i for i, _ in rows]


def start(manifest: Path, out: Path, model: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "service.cli", "embed-catalog", str(manifest), "--out", str(out)]
    argv += ["--model", str(model), "--precision", "float32", "--shard-size", str(SHARD), "--batch-size", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_shards(proc: subprocess.Popen[str], out: Path, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(shard_paths(out)) < count:
        if proc.poll() is not None:
            pytest.fail(f"the job ended early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {count} shards within {WAIT_S} s: {proc.communicate()[1]}")
        time.sleep(0.05)
    time.sleep(0.3)  # the job is now blocked on the pipe: nothing else can be committed
    assert proc.poll() is None


def replace_fifo(fifo: Path) -> None:
    fifo.unlink()
    fifo.write_bytes(encode(picture(4242, 180, 240), "JPEG"))


def clean_run(run_cli: RunCli, manifest: Path, fifo: Path, out: Path) -> np.ndarray:
    result = run_cli(manifest, out, "--shard-size", "100")
    assert result.code == 0, result.err
    return read_catalog(out).embeddings


def test_kill_9_then_rerun_resumes(tree: ImageTree, tiny_path: Path, run_cli: RunCli, tmp_path: Path) -> None:
    manifest, fifo, ids = make_manifest(tree, tmp_path / "src")
    out = tmp_path / "cat"
    proc = start(manifest, out, tiny_path)
    # items 0..9 before the pipe: 9 good rows -> shards of 3, 3 (then 3 more rows wait in the buffer)
    wait_for_shards(proc, out, 2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    committed = read_catalog(out).ids
    assert committed == ids[:4] + ids[5:7]  # the first 6 good rows; the broken one went to errors.jsonl
    assert [f.id for f in read_failures(out)] == ["bad-truncated"]

    replace_fifo(fifo)
    rerun = start(manifest, out, tiny_path)
    stdout, stderr = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, stderr
    assert "(7 already done)" in stderr  # 6 committed rows + 1 recorded failure
    assert stdout.strip() == (
        f"done: {len(ids) - 7} rows written, 0 errors, 7 already done; catalog holds {len(ids) - 1} rows "
        + f"and 1 errors; {stdout.split('errors; ')[1].strip()}"
    )
    catalog = read_catalog(out)
    assert catalog.ids == [i for i in ids if i != "bad-truncated"]  # each id exactly once, source order
    assert [f.id for f in read_failures(out)] == ["bad-truncated"]
    reference = clean_run(run_cli, manifest, fifo, tmp_path / "clean")
    np.testing.assert_allclose(catalog.embeddings, reference, rtol=0, atol=1e-5)


def test_sigint_commits_what_is_done_and_exits_130(
    tree: ImageTree, tiny_path: Path, run_cli: RunCli, tmp_path: Path
) -> None:
    manifest, fifo, ids = make_manifest(tree, tmp_path / "src")
    out = tmp_path / "cat"
    proc = start(manifest, out, tiny_path)
    wait_for_shards(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)  # exits although a worker is still blocked on the pipe
    assert proc.returncode == 130, stderr
    assert "stopping: committing the rows embedded so far" in stderr
    # Every row the job had embedded is committed: a prefix of the source, without gaps. Usually all 9 good
    # rows before the pipe; fewer if SIGINT came while the last ones were still being decoded (busy CI).
    committed = read_catalog(out).ids
    before_pipe = [i for i in ids[:FIFO_AT] if i != "bad-truncated"]
    assert len(committed) >= 2 * SHARD and committed == before_pipe[: len(committed)]
    n = len(committed)
    summary = f"interrupted: {n} rows written, 1 errors, 0 already done; catalog holds {n} rows"
    assert stdout.startswith(summary)
    assert not list(out.glob("*.tmp"))

    replace_fifo(fifo)
    result = run_cli(manifest, out, "--shard-size", str(SHARD), "--batch-size", "2")
    assert result.code == 0, result.err
    assert result.out.startswith(f"done: {len(ids) - n - 1} rows written, 0 errors, {n + 1} already done")
    catalog = read_catalog(out)
    assert catalog.ids == [i for i in ids if i != "bad-truncated"]
    reference = clean_run(run_cli, manifest, fifo, tmp_path / "clean")
    np.testing.assert_allclose(catalog.embeddings, reference, rtol=0, atol=1e-5)
