"""Index hot swap: a real ``vitembed serve`` process on loopback keeps answering while its table is rebuilt
under it (``vitembed index build --overwrite``, as the Kubernetes index Job does), then answers from the new
version — new rows, and new embedding options bound to the served model — without a restart and without a
5xx, while a client keeps searching throughout."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from vitembed.cli.main import main

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

HOST = "127.0.0.1"


def _catalog(images: Images, root: Path, prefix: str, seeds: range, tiny_path: Path, *flags: str) -> Path:
    """``embed-catalog`` of distinct pictures named ``{prefix}{i}``; returns the catalog folder."""
    folder = root / f"photos-{prefix}"
    folder.mkdir()
    with (root / f"{prefix}.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "path"])
        for i, seed in enumerate(seeds):
            path = folder / f"{prefix}{i}.jpg"
            path.write_bytes(images.jpeg(64 + 9 * i, 80 - 3 * i, seed=seed))
            writer.writerow([f"{prefix}{i}", str(path)])
    out = root / f"catalog-{prefix}"
    argv = ["embed-catalog", str(root / f"{prefix}.csv"), "--out", str(out), "--model", f"tiny={tiny_path}"]
    assert main([*argv, "--precision", "float32", *flags]) == 0
    return out


def _build(catalog: Path, db: Path) -> None:
    assert main(["index", "build", str(catalog), "--db", str(db), "--table", "products", "--overwrite"]) == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _start(tiny_path: Path, db: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITEMBED_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VITEMBED_TORCH_THREADS="1")
    argv = [
        sys.executable, "-m", "vitembed", "serve", "--model", f"tiny={tiny_path}", "--host", HOST,
        "--port", str(port), "--precision", "float32", "--index", f"products={db}:products",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"vitembed serve did not become ready:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def _top(client: httpx.Client, photo: bytes) -> tuple[int, str, float]:
    response = client.post("/v1/search", files={"image": ("q.jpg", photo, "image/jpeg")}, data={"k": "1"})
    if response.status_code != 200:
        return response.status_code, "", 0.0
    (hit,) = response.json()["data"][0]["results"]
    return 200, hit["id"], hit["score"]


def test_a_rebuilt_table_is_served_without_a_restart(images: Images, tiny_path: Path, tmp_path: Path) -> None:
    first = _catalog(images, tmp_path, "a", range(100, 106), tiny_path)
    same_options = _catalog(images, tmp_path, "b", range(200, 206), tiny_path)
    new_options = _catalog(images, tmp_path, "c", range(300, 306), tiny_path, "--pooling", "mean")
    db = tmp_path / "db"
    _build(first, db)
    photo = {
        name: (tmp_path / f"photos-{name[0]}" / f"{name}.jpg").read_bytes() for name in ("a2", "b3", "c4")
    }

    proc, url = _start(tiny_path, db, tmp_path / "serve.log")
    statuses: list[int] = []
    stop = threading.Event()
    searching = threading.Event()  # the searcher has had three answers

    def keep_searching() -> None:  # a client searching all along: no 5xx, ever
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
            while not stop.is_set():
                statuses.append(_top(client, photo["a2"])[0])
                if len(statuses) >= 3:
                    searching.set()

    try:
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
            status, top, score = _top(client, photo["a2"])
            assert (status, top) == (200, "a2") and score == pytest.approx(1.0, abs=1e-5)
            searcher = threading.Thread(target=keep_searching)
            searcher.start()
            try:
                assert searching.wait(60), f"the searcher got no three answers: {statuses}"
                _build(same_options, db)  # new rows, same embedding options
                status, top, score = _top(client, photo["b3"])
                assert (status, top) == (200, "b3") and score == pytest.approx(1.0, abs=1e-5)
                _build(new_options, db)  # other pooling: the index is bound again with the table's options
                status, top, score = _top(client, photo["c4"])
                assert (status, top) == (200, "c4")
                assert score == pytest.approx(1.0, abs=1e-5)  # the query was embedded with mean pooling too
                described = client.get("/v1/indexes").json()
                (entry,) = [item for item in described["data"] if item["name"] == "products"]
                assert entry["rows"] == 6 and entry["meta"]["pooling"] == "mean"
            finally:
                stop.set()
                searcher.join(60)
        assert statuses and set(statuses) == {200}, sorted(set(statuses))
        assert proc.poll() is None  # the same process served every version
    finally:
        proc.terminate()
        try:
            proc.wait(35)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
