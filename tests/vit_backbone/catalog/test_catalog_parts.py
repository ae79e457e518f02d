"""The catalog's parts on their own: metadata round trip and comparison, shard reading refusals, the
errors file's torn-line repair, ordered prefetching with per-item errors and stop, and source parsing."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from vitembed.cli.embed_catalog import parse_model

from vit_backbone.catalog.error_log import ERRORS_FILE, ErrorLog, ItemFailure, read_failures
from vit_backbone.catalog.errors import CatalogError, SourceError
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.prefetch import OrderedPrefetcher, Stopped
from vit_backbone.catalog.shards import build_table, read_catalog, shard_paths, write_shard
from vit_backbone.catalog.sources import open_source

META = CatalogMeta(
    model="embedded",
    revision="rev-1",
    preprocess_hash="abc",
    pooling="mean",
    layers=[8],
    size=None,
    policy="pad",
    normalized=False,
    dim=4,
    dtype="float32",
)


def test_meta_round_trip_and_mismatch() -> None:
    assert CatalogMeta.from_json(META.to_json()) == META
    assert CatalogMeta.from_json(META.to_json().encode()) == META
    other = dataclasses.replace(
        META, model="other-name", pooling="cls", layers=None, size=[448, 448], dtype="float16"
    )
    assert META.embed_options_mismatch(other) == [
        "pooling: mean != cls",
        "layers: [8] != default",
        "size: default != [448, 448]",
    ]
    assert META.embed_options_mismatch(dataclasses.replace(META, model="x", dtype="float16")) == []
    with pytest.raises(CatalogError, match="format_version 2 is not supported"):
        CatalogMeta.from_dict({**META.to_dict(), "format_version": 2})
    with pytest.raises(CatalogError, match="lacks revision"):
        CatalogMeta.from_dict({k: v for k, v in META.to_dict().items() if k != "revision"})
    with pytest.raises(CatalogError, match="dtype must be one of float32, float16"):
        dataclasses.replace(META, dtype="int8")
    # precision is informational: absent in older catalogs, never a mismatch
    older = {k: v for k, v in META.to_dict().items() if k != "precision"}
    assert CatalogMeta.from_dict(older) == META and META.precision is None
    computed = dataclasses.replace(META, precision="bfloat16")
    assert CatalogMeta.from_json(computed.to_json()).precision == "bfloat16"
    assert META.embed_options_mismatch(computed) == []


def test_read_catalog_refuses_missing_empty_and_mixed(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="does not exist"):
        read_catalog(tmp_path / "nope")
    with pytest.raises(CatalogError, match=r"holds no catalog shards \(part-\*.parquet\)"):
        read_catalog(tmp_path)
    vectors = np.arange(8, dtype=np.float32).reshape(2, 4)
    write_shard(tmp_path, 0, build_table(["a", "b"], vectors, {}, META))
    committed = (tmp_path / "part-00000.parquet").read_bytes()
    with pytest.raises(CatalogError, match="already exists"):
        write_shard(tmp_path, 0, build_table(["x"], vectors[:1], {}, META))
    assert (tmp_path / "part-00000.parquet").read_bytes() == committed  # never overwritten
    assert not list(tmp_path.glob("*.tmp"))
    write_shard(tmp_path, 1, build_table(["c"], vectors[:1], {}, dataclasses.replace(META, pooling="cls")))
    mixed = r"part-00001.parquet was made with other options .*pooling: mean != cls"
    with pytest.raises(CatalogError, match=mixed):
        read_catalog(tmp_path)
    (tmp_path / "part-00001.parquet").unlink()
    write_shard(tmp_path, 1, build_table(["a"], vectors[:1], {}, META))
    with pytest.raises(CatalogError, match="duplicate ids"):
        read_catalog(tmp_path)
    with pytest.raises(CatalogError, match=r"expected embeddings \[1, 4\], got \[2, 4\]"):
        build_table(["z"], vectors, {}, META)
    (tmp_path / "part-00002.parquet.tmp").write_bytes(b"partial")
    assert [p.name for p in shard_paths(tmp_path)] == ["part-00000.parquet", "part-00001.parquet"]


def test_error_log_cuts_a_torn_line(tmp_path: Path) -> None:
    log = ErrorLog(tmp_path)
    log.append(ItemFailure("a", "/x/a.jpg", "truncated", "cut"))
    log.close()
    with (tmp_path / ERRORS_FILE).open("a") as handle:
        handle.write('{"id": "b", "path": "/x/b.j')  # the process died mid-write
    resumed = ErrorLog(tmp_path)
    assert resumed.ids == {"a"}
    resumed.append(ItemFailure("c", "/x/c.jpg", "empty", "0 bytes"))
    resumed.close()
    assert [f.id for f in read_failures(tmp_path)] == ["a", "c"]
    lines = (tmp_path / ERRORS_FILE).read_text().splitlines()
    assert json.loads(lines[1]) == {"id": "c", "path": "/x/c.jpg", "code": "empty", "message": "0 bytes"}


def test_prefetcher_keeps_order_records_errors_and_stops() -> None:
    def work(n: int) -> int:
        time.sleep(0.01 * (n % 3))  # finish out of order
        if n == 5:
            raise ValueError("five")
        return n * n

    seen = list(OrderedPrefetcher(work, list(range(12)), workers=3, depth=4))
    assert [n for n, _ in seen] == list(range(12))
    assert [r for n, r in seen if n != 5] == [n * n for n in range(12) if n != 5]
    assert isinstance(seen[5][1], ValueError) and str(seen[5][1]) == "five"

    stop = threading.Event()
    blocker = threading.Event()

    def slow(n: int) -> int:
        if n == 2:
            blocker.wait(5)
        return n

    got = []
    with pytest.raises(Stopped):
        for n, _ in OrderedPrefetcher(slow, list(range(6)), workers=2, depth=3, stop=stop):
            got.append(n)
            if n == 1:
                stop.set()
    blocker.set()
    assert got == [0, 1]


def test_source_parsing(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "b.JPG").write_bytes(b"x")
    (tmp_path / "img" / "a.png").write_bytes(b"x")
    (tmp_path / "img" / "skip.txt").write_text("x")
    folder = open_source(tmp_path / "img")
    assert [i.id for i in folder.items] == ["a.png", "b.JPG"] and folder.kind == "folder"
    with pytest.raises(SourceError, match="holds no images"):
        open_source(_empty(tmp_path))
    with pytest.raises(SourceError, match="does not exist"):
        open_source(tmp_path / "missing.csv")
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text(
        '{"id": "1", "path": "img/a.png", "tag": null}\n\n{"id": 2, "path": "/abs/b.jpg", "w": 3}\n'
    )
    source = open_source(jsonl)
    assert [(i.id, i.path, i.extra) for i in source.items] == [
        ("1", str(tmp_path / "img/a.png"), ("", "")),
        ("2", "/abs/b.jpg", ("", "3")),
    ]
    assert source.extra_columns == ("tag", "w")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "path": "a.png"}\n[1, 2]\n')
    with pytest.raises(SourceError, match=r"bad.jsonl:2: expected a JSON object, got list"):
        open_source(bad)
    empty_id = tmp_path / "e.csv"
    empty_id.write_text("id,path\n,a.png\n")
    with pytest.raises(SourceError, match="row 1: 'id' must be a non-empty string"):
        open_source(empty_id)


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "readme.txt").write_text("x")
    return folder


def test_relative_model_folders_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray workers run in other working directories: a model folder is sent as an absolute path."""
    (tmp_path / "models" / "dino").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    folder = str(tmp_path / "models" / "dino")
    assert parse_model("models/dino") == ("dino", folder)
    assert parse_model("mine=models/dino") == ("mine", folder)
    assert parse_model("embedded") == ("embedded", "embedded")
    assert parse_model("org/hub-id") == ("org/hub-id", "org/hub-id")
