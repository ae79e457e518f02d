"""``vitembed embed-catalog --server URL`` against a real ``vitembed serve`` on loopback (the tiny DINOv2).

The catalog made through the server equals the one made in process for the same images and options: the
same ids in the same shards, vectors within 1e-4, the same shard metadata and catalog.json (model location
included, so ``vitembed search`` can load the model later), the same errors.jsonl codes for broken images
mixed into batches. A server killed mid-job stops the job with one line and exit status 1, committed shards
kept; the same command against a new server resumes and ends with every id exactly once. Options the server
cannot honour are refused in one line with status 2, before any file is made. A keyed server needs
``--api-key`` (or ``$VITEMBED_API_KEY``); a server that answers 429 is waited for.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_server_process import ROOT, SLOW_FLAGS, ServerProcess, start_server
from vitembed.cli.main import main

from vit_backbone.catalog.error_log import read_failures
from vit_backbone.catalog.meta import META_KEY, CatalogMeta
from vit_backbone.catalog.shards import read_catalog, shard_paths

TOL = 1e-4
PAUSED_JOB = ROOT / "tests" / "vit_backbone" / "catalog" / "paused_job.py"
WAIT_S = 120.0


@dataclass(frozen=True)
class Tree:
    root: Path
    good: list[str]  # sorted ids
    bad: dict[str, str]  # id -> the errors.jsonl code


def _picture(seed: int, height: int, width: int, fmt: str) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    a, b, c = rng.uniform(-3, 3, size=3)
    base = np.stack([np.sin(a * xx * 6 + k + b * yy * 6 + c) for k in range(3)], -1) * 100 + 120
    noisy = base + rng.integers(0, 30, size=(height, width, 3))  # [H, W, 3]
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    root = tmp_path_factory.mktemp("catalog-server") / "images"
    (root / "sub").mkdir(parents=True)
    good = []
    for k, (height, width) in enumerate([(120, 160), (90, 90), (200, 80), (64, 256), (150, 100)] * 3):
        rel = f"{'sub/' if k % 2 else ''}img-{k:02d}.{'png' if k % 3 == 0 else 'jpg'}"
        (root / rel).write_bytes(_picture(k, height, width, "PNG" if rel.endswith("png") else "JPEG"))
        good.append(rel)
    jpeg = _picture(99, 240, 320, "JPEG")
    (root / "sub" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (root / "not_image.png").write_bytes(b"this is not an image, just some text\n" * 10)
    (root / "img-05b.jpg").write_bytes(b"")
    bad = {"sub/truncated.jpg": "truncated", "not_image.png": "not_an_image", "img-05b.jpg": "empty"}
    return Tree(root, sorted(good), bad)


@pytest.fixture(scope="module")
def process(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tiny_path, tmp_path_factory.mktemp("serve_catalog"))
    try:
        yield server
    finally:
        assert server.stop() == 0, server.log()


def catalog(source: Path, out: Path, *flags: str) -> list[str]:
    return ["embed-catalog", str(source), "--out", str(out), "--shard-size", "5", "--batch-size", "4", *flags]


def shard_metas(out: Path) -> list[tuple[int, CatalogMeta]]:
    return [
        (pq.read_metadata(p).num_rows, CatalogMeta.from_json(pq.read_schema(p).metadata[META_KEY]))
        for p in shard_paths(out)
    ]


@pytest.mark.parametrize(
    "options",
    [
        (),
        ("--pooling", "mean", "--layers", "-2", "-1", "--normalize", "--policy", "pad", "--dtype", "float16"),
    ],
    ids=["defaults", "mean-layers-pad-float16"],
)
def test_the_server_catalog_equals_the_in_process_one(
    options: tuple[str, ...],
    process: ServerProcess,
    tree: Tree,
    tiny_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    model = ("--model", f"tiny={tiny_path}", "--precision", "float32")  # the server's name and precision
    assert main(catalog(tree.root, local, *model, *options)) == 0
    capsys.readouterr()
    flags = ("--server", process.url, "--precision", "float32", "--concurrency", "3")
    assert main(catalog(tree.root, remote, *flags, *options)) == 0
    captured = capsys.readouterr()
    assert f"on {process.url}" in captured.err and "3 in flight" in captured.err
    assert (
        captured.out.strip()
        .splitlines()[-1]
        .startswith(f"done: {len(tree.good)} rows written, {len(tree.bad)} errors, 0 already done;")
    )
    assert f"(see {remote / 'errors.jsonl'})" in captured.out

    made, expected = read_catalog(remote), read_catalog(local)
    assert made.ids == expected.ids == tree.good  # source order, broken images left out
    np.testing.assert_allclose(made.embeddings, expected.embeddings, rtol=0, atol=TOL)
    assert made.meta == expected.meta and made.meta.model_location == str(tiny_path.resolve())
    assert shard_metas(remote) == shard_metas(local)  # 15 rows: 5 + 5 + 5, each shard's meta
    assert json.loads((remote / "catalog.json").read_text()) == json.loads(
        (local / "catalog.json").read_text()
    )
    failures = read_failures(remote)
    assert {f.id: f.code for f in failures} == {f.id: f.code for f in read_failures(local)} == tree.bad
    assert all(f.path == str(tree.root / f.id) and f.message for f in failures)

    # either path resumes the other's catalog: nothing left to do
    assert main(catalog(tree.root, local, *flags, *options)) == 0
    assert "0 rows written, 0 errors, 18 already done" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--device", "cpu"), "--device cannot be used with --server: the server decodes the images"),
        (("--engine", "ray", "--workers", "2"), "--engine ray, --workers cannot be used with --server"),
        (("--precision", "bfloat16"), "--precision bfloat16: the server at URL computes in float32; drop"),
        (("--model", "tinny"), "the server at URL does not serve model 'tinny' (it serves: tiny)"),
        (("--size", "7"), "the server at URL refused the job's options: "),
        (("--layers", "9"), "the server at URL refused the job's options: "),
    ],
)
def test_what_the_server_cannot_honour_is_one_line_and_status_2(
    flags: tuple[str, ...],
    message: str,
    process: ServerProcess,
    tree: Tree,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    capsys.readouterr()
    assert main(catalog(tree.root, tmp_path / "out", "--server", process.url, *flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vitembed embed-catalog: error: {message.replace('URL', process.url)}"), err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_server_only_flags_need_server(
    tree: Tree, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(catalog(tree.root, tmp_path / "out", "--concurrency", "2", "--retry-for", "3")) == 2
    assert (
        capsys.readouterr().err
        == "vitembed embed-catalog: error: --concurrency, --retry-for needs --server URL\n"
    )


class PausedJob:
    """``embed-catalog --server`` in its own process, paused right after its first shard (paused_job.py)."""

    def __init__(self, argv: list[str]) -> None:
        self.ready, ready_w = os.pipe()
        gate_r, self.gate = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, str(PAUSED_JOB), str(ready_w), str(gate_r), *argv],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "VITEMBED_API_KEY"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=(ready_w, gate_r),
        )
        os.close(ready_w)
        os.close(gate_r)

    def wait_first_shard(self) -> None:
        readable, _, _ = select.select([self.ready], [], [], WAIT_S)
        if not readable or os.read(self.ready, 1) != b"1":
            self.proc.kill()
            pytest.fail(f"no first shard: {self.proc.communicate()[1]}")

    def release(self) -> tuple[int, str, str]:
        os.write(self.gate, b"1")
        out, err = self.proc.communicate(timeout=WAIT_S)
        return self.proc.returncode, out, err


def test_a_server_killed_mid_job_stops_it_resumably(
    tiny_path: Path, tree: Tree, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    server = start_server(tiny_path, tmp_path)
    flags = ["--shard-size", "2", "--batch-size", "2", "--concurrency", "2", "--retry-for", "1"]
    job = PausedJob(["embed-catalog", str(tree.root), "--out", str(out), "--server", server.url, *flags])
    job.wait_first_shard()
    server.proc.send_signal(signal.SIGKILL)  # gone at once, mid-job: no drain
    server.stop()
    code, _, err = job.release()
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"vitembed embed-catalog: error: cannot reach the server at {server.url}"), err
    assert last.endswith("rows committed: run the same command again to resume")
    committed = read_catalog(out).ids
    recorded = [f.id for f in read_failures(out)]
    everything = sorted([*tree.good, *tree.bad])  # the source's order
    done = sorted([*committed, *recorded])
    assert len(committed) >= 2 and done == everything[: len(done)]  # a gap-free prefix of the source
    assert f"stopped with {len(committed)} rows committed" in last

    again = start_server(tiny_path, tmp_path)
    try:
        capsys.readouterr()
        argv = ["embed-catalog", str(tree.root), "--out", str(out), "--server", again.url, *flags]
        assert main(argv) == 0
        summary = capsys.readouterr().out.strip().splitlines()[-1]
    finally:
        assert again.stop() == 0
    left = len(everything) - len(done)
    assert summary.startswith(f"done: {len(tree.good) - len(committed)} rows written, ")
    assert (
        f"{len(done)} already done; catalog holds {len(tree.good)} rows and {len(tree.bad)} errors" in summary
    )
    assert read_catalog(out).ids == tree.good and left > 0  # every id once, in source order
    assert {f.id: f.code for f in read_failures(out)} == tree.bad


def test_a_keyed_server_needs_the_key_and_a_busy_one_is_waited_for(
    tiny_path: Path, tree: Tree, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(tiny_path, tmp_path, *SLOW_FLAGS, env={"VITEMBED_API_KEY": "sesame"})
    try:
        argv = catalog(tree.root, tmp_path / "out", "--server", server.url, "--concurrency", "4")
        capsys.readouterr()
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(
            f"vitembed embed-catalog: error: the server at {server.url} refused the API key"
        )
        assert err.count("\n") == 1 and not (tmp_path / "out").exists()

        assert main([*argv, "--api-key", "sesame"]) == 0  # 4 requests of 4 at once; the queue holds 4 images
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"done: {len(tree.good)} rows")
        assert read_catalog(tmp_path / "out").ids == tree.good
        assert server.metric("vitembed_requests_total", route="/v1/embed", status="429") >= 1
    finally:
        assert server.stop() == 0
