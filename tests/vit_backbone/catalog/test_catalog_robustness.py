"""What must never stop or corrupt an ``embed-catalog`` job: undecodable file names, a forward pass that
raises for one image, non-regular files, a second job on the same folder; ``--retry-errors``; refused
manifest columns; the progress bar's output."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from catalog_images import ImageTree, encode, picture

from vit_backbone import Backbone
from vit_backbone.catalog.decode_stage import _ReadError, read_file
from vit_backbone.catalog.error_log import ERRORS_FILE, read_failures
from vit_backbone.catalog.job_folder import read_job_file
from vit_backbone.catalog.shards import read_catalog
from vit_backbone.errors import ImageDecodeError

if TYPE_CHECKING:
    from conftest import RunCli  # tests/catalog/conftest.py (typing only: 'conftest' is ambiguous at runtime)

TOL = 1e-5


def small_folder(tree: ImageTree, folder: Path, count: int = 5) -> list[str]:
    folder.mkdir()
    for rel in tree.good[:count]:
        shutil.copy(tree.root / rel, folder / rel.replace("/", "_"))
    return sorted(rel.replace("/", "_") for rel in tree.good[:count])


def library(backbone: Backbone, folder: Path, ids: list[str]) -> np.ndarray:
    return np.stack([backbone.embed([(folder / i).read_bytes()])[0] for i in ids])  # [N, D]


def test_undecodable_file_name_is_an_error_record_on_every_run(
    tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path
) -> None:
    folder = tmp_path / "src"
    good = small_folder(tree, folder, 3)
    raw = os.fsencode(folder) + b"/caf\xe9-\xff.jpg"  # Latin-1 bytes: not UTF-8
    with open(raw, "wb") as handle:
        handle.write((folder / good[0]).read_bytes())
    escaped = "caf\\udce9-\\udcff.jpg"  # backslashreplace of the surrogates Python decodes them to
    out = tmp_path / "cat"
    first = run_cli(folder, out)
    assert first.code == 0, first.err
    assert first.out.startswith("done: 3 rows written, 1 errors, 0 already done")
    [failure] = read_failures(out)
    assert (failure.id, failure.code) == (escaped, "invalid_name")
    assert failure.path == str(folder) + "/" + escaped and "not valid UTF-8" in failure.message
    line = (out / ERRORS_FILE).read_bytes()
    assert line.decode("utf-8").count("\n") == 1 and b"\\\\udce9" in line  # valid UTF-8, escapes kept
    again = run_cli(folder, out)
    assert again.code == 0, again.err
    assert again.out.strip() == (
        f"done: 0 rows written, 0 errors, 4 already done; catalog holds 3 rows and 1 errors "
        f"(see {out / ERRORS_FILE}); nothing left to embed"  # no "0.0 images/s" for a finished catalog
    )
    assert read_catalog(out).ids == good


def test_forward_failure_fails_only_that_image(
    tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model raises whenever a batch holds a/b/c/x.png (150x100): its batch is retried image by image,
    the other images of that batch are embedded, only that one is an ``internal_error``."""
    real = Backbone.embed_prepared

    def embed_prepared(self: Backbone, prepared: list[Any], **options: Any) -> np.ndarray:
        if any(p.source_size == (150, 100) for p in prepared):
            raise RuntimeError("boom: kernel failed")
        return real(self, prepared, **options)

    monkeypatch.setattr(Backbone, "embed_prepared", embed_prepared)
    out = tmp_path / "cat"
    result = run_cli(tree.root, out, "--batch-size", "4")
    assert result.code == 0, result.err
    assert result.out.startswith(f"done: {len(tree.good) - 1} rows written, {len(tree.bad) + 1} errors")
    failures = {f.id: (f.code, f.message) for f in read_failures(out)}
    assert failures["a/b/c/x.png"] == (
        "internal_error",
        "the forward pass failed: RuntimeError: boom: kernel failed",
    )
    catalog = read_catalog(out)
    assert catalog.ids == [i for i in tree.good if i != "a/b/c/x.png"]
    monkeypatch.setattr(Backbone, "embed_prepared", real)
    np.testing.assert_allclose(catalog.embeddings, library(tiny, tree.root, catalog.ids), rtol=0, atol=TOL)


def test_retry_errors_tries_dropped_codes_again(
    tree: ImageTree, tiny: Backbone, run_cli: RunCli, tmp_path: Path
) -> None:
    folder = tmp_path / "src"
    good = small_folder(tree, folder, 3)
    jpeg = encode(picture(77, 120, 90), "JPEG")
    (folder / "z-cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (folder / "z-empty.jpg").write_bytes(b"")
    out = tmp_path / "cat"
    assert run_cli(folder, out).code == 0
    assert {f.id: f.code for f in read_failures(out)} == {"z-cut.jpg": "truncated", "z-empty.jpg": "empty"}
    (folder / "z-cut.jpg").write_bytes(jpeg)  # fixed on disk
    (folder / "z-empty.jpg").write_bytes(jpeg)
    plain = run_cli(folder, out)  # recorded failures are final unless retried
    assert plain.out.startswith("done: 0 rows written, 0 errors, 5 already done")
    only_cut = run_cli(folder, out, "--retry-errors", "truncated")
    assert only_cut.code == 0, only_cut.err
    assert "1 failures to retry" in only_cut.err
    assert only_cut.out.startswith("done: 1 rows written, 0 errors, 4 already done")
    assert [f.id for f in read_failures(out)] == ["z-empty.jpg"]
    everything = run_cli(folder, out, "--retry-errors")
    assert everything.out.startswith(
        "done: 1 rows written, 0 errors, 4 already done; catalog holds 5 rows and 0"
    )
    assert read_failures(out) == [] and not list(out.glob("*.tmp"))
    catalog = read_catalog(out)
    assert sorted(catalog.ids) == sorted([*good, "z-cut.jpg", "z-empty.jpg"])  # each id exactly once
    assert len(catalog.ids) == len(set(catalog.ids)) == 5
    np.testing.assert_allclose(catalog.embeddings, library(tiny, folder, catalog.ids), rtol=0, atol=TOL)


def test_a_second_job_on_the_same_folder_is_refused(tree: ImageTree, run_cli: RunCli, tmp_path: Path) -> None:
    folder = tmp_path / "src"
    small_folder(tree, folder, 2)
    out = tmp_path / "cat"
    out.mkdir()
    with open(out / ".lock", "a") as held:  # what a running job holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused = run_cli(folder, out)
    assert refused.code == 2
    assert refused.err == (
        f"vitembed embed-catalog: error: another embed-catalog job is writing to {out} "
        f"(it holds {out}/.lock); wait for it to finish, or write to another --out folder\n"
    )
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    assert run_cli(folder, out).code == 0  # released with its holder


def test_non_regular_files_and_size_limits(tree: ImageTree, run_cli: RunCli, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    (tmp_path / "dir.jpg").mkdir()
    manifest = tmp_path / "m.csv"
    manifest.write_text(f"id,path\nok,{tree.root / tree.good[0]}\npipe,{fifo}\ndir,{tmp_path / 'dir.jpg'}\n")
    result = run_cli(manifest, tmp_path / "cat")  # a FIFO must not block the job
    assert result.code == 0, result.err
    failures = {f.id: (f.code, f.message) for f in read_failures(tmp_path / "cat")}
    assert failures == {
        "pipe": ("read_error", f"cannot read {fifo}: not a regular file"),
        "dir": ("read_error", f"cannot read {tmp_path / 'dir.jpg'}: not a regular file"),
    }
    # the size comes from reading at most max_bytes + 1 bytes, not from st_size (0 for /proc files)
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(ImageDecodeError, match="more than 16 bytes") as caught:
        read_file("/proc/self/status", 16)
    assert caught.value.code == "too_large"
    exact = tmp_path / "exact.bin"
    exact.write_bytes(b"x" * 16)
    assert read_file(str(exact), 16) == b"x" * 16
    with pytest.raises(_ReadError, match="No such file"):
        read_file(str(tmp_path / "missing.jpg"), 16)


def test_reserved_and_repeated_manifest_columns_are_refused(
    tree: ImageTree, run_cli: RunCli, tmp_path: Path
) -> None:
    image = tree.root / tree.good[0]
    reserved = tmp_path / "reserved.csv"
    reserved.write_text(f"id,path,embedding\na,{image},x\n")
    result = run_cli(reserved, tmp_path / "a")
    assert result.code == 2
    assert result.err == (
        f"vitembed embed-catalog: error: manifest {reserved} has a column named embedding, which the catalog "
        "keeps for the vectors; rename that column\n"
    )
    repeated = tmp_path / "repeated.csv"
    repeated.write_text(f"id,path,label,label\na,{image},x,y\n")
    result = run_cli(repeated, tmp_path / "b")
    assert result.code == 2 and f"manifest {repeated} names the column(s) label more than once" in result.err
    table = pa.Table.from_arrays(
        [pa.array(["a"]), pa.array([str(image)]), pa.array(["p"])], ["id", "path", "id"]
    )
    parquet = tmp_path / "repeated.parquet"
    pq.write_table(table, parquet)
    result = run_cli(parquet, tmp_path / "c")
    assert result.code == 2 and "names the column(s) id more than once" in result.err
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))


def test_progress_bar_shows_rate_total_and_eta(tree: ImageTree, run_cli: RunCli, tmp_path: Path) -> None:
    result = run_cli(tree.root, tmp_path / "cat", "--progress")
    assert result.code == 0, result.err
    total = len(tree.good) + len(tree.bad)
    # tqdm's line: "embedding: 100%|…| 16/16 [00:00<00:00, 41.2img/s, errors=4]": done/total, elapsed<ETA
    assert re.search(
        rf"embedding: +100%\|.*\| {total}/{total} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+img/s", result.err
    )
    assert f"errors={len(tree.bad)}" in result.err


def test_missing_tqdm_names_the_extra(
    tree: ImageTree, run_cli: RunCli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    result = run_cli(tree.root, tmp_path / "cat")
    assert result.code == 2
    assert result.err == (
        "vitembed embed-catalog: error: the embed-catalog progress bar needs an optional dependency: "
        "pip install -e '.[catalog]' (from a clone of vitembed)\n"
    )
    assert not (tmp_path / "cat").exists()


def test_job_file_reads_back_typed(tree: ImageTree, run_cli: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "cat"
    assert run_cli(tree.root, out, "--dtype", "float16").code == 0
    found = read_job_file(out)
    assert found is not None
    assert found.meta.dtype == "float16" and found.meta.precision == "float32"
    record = found.record
    assert (record.source, record.source_kind, record.extra_columns) == (str(tree.root), "folder", ())
    assert (record.precision, record.precision_used, record.items) == ("float32", "float32", 16)
    raw = json.loads((out / "catalog.json").read_text())
    assert raw["job"]["extra_columns"] == [] and raw["precision"] == "float32"
