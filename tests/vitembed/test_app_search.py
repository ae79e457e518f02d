"""POST /v1/search and GET /v1/indexes: in process against the real engine and a real LanceDB table (built by
the real ``embed-catalog`` job and ``index build``), then once as a real ``vitembed serve`` process on
loopback against the ``vitembed search`` command. The server's hits equal the library's (ids, scores to
1e-5); errors have exact bodies; an index no served model can query stops start-up."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest
from pydantic import ValidationError
from vitembed.cli.main import main
from vitembed.cli.serve import SettingsError
from vitembed.settings import ServiceSettings, parse_index_args

from vit_backbone import Backbone
from vit_backbone.catalog.index_build import IndexOptions, add_catalog, build_index, connect, create_table
from vit_backbone.catalog.index_search import SimilarityIndex, embed_queries
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.shards import read_catalog

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images, OpenServer, Server

pytestmark = pytest.mark.anyio
TOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
BRANDS = ("acme", "globex")
N_IMAGES = 10


@dataclass(frozen=True)
class Photos:
    folder: Path
    data: dict[str, bytes]  # id -> JPEG bytes, also written as folder/{id}.jpg

    def manifest(self, ids: list[str], path: Path) -> Path:
        """A CSV manifest of ``ids`` with a ``brand`` column (BRANDS alternating by photo number)."""
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["id", "path", "brand"])
            for item in ids:
                writer.writerow([item, str(self.folder / f"{item}.jpg"), BRANDS[int(item[1:]) % 2]])
        return path


@dataclass(frozen=True)
class Indexed:
    db: Path
    catalog: Path


@pytest.fixture(scope="module")
def photos(images: Images, tmp_path_factory: pytest.TempPathFactory) -> Photos:
    """Distinct random pictures of varied sizes."""
    folder = tmp_path_factory.mktemp("search-photos")
    data = {}
    for i in range(N_IMAGES):
        data[f"p{i:02d}"] = images.jpeg(60 + 13 * i, 90 - 5 * i, seed=100 + i)
        (folder / f"p{i:02d}.jpg").write_bytes(data[f"p{i:02d}"])
    return Photos(folder, data)


def embed_catalog(photos: Photos, ids: list[str], root: Path, tiny_path: Path) -> Path:
    manifest = photos.manifest(ids, root / "manifest.csv")
    argv = ["embed-catalog", str(manifest), "--out", str(root / "cat"), "--model", f"tiny={tiny_path}"]
    assert main([*argv, "--precision", "float32"]) == 0
    return root / "cat"


@pytest.fixture(scope="module")
def indexed(photos: Photos, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Indexed:
    """The first 8 photos embedded by ``embed-catalog`` as model ``tiny`` and indexed as ``products``."""
    root = tmp_path_factory.mktemp("search-db")
    catalog = embed_catalog(photos, list(photos.data)[:8], root, tiny_path)
    build_index(catalog, root / "db", "products")
    return Indexed(root / "db", catalog)


@pytest.fixture(scope="module")
def db(indexed: Indexed) -> Path:
    return indexed.db


@pytest.fixture(scope="module")
async def search_server(serve: OpenServer, db: Path) -> Any:
    async with serve(indexes={"products": f"{db}:products"}) as opened:
        yield opened


def expected_hits(
    reference: Backbone, db: Path, data: list[bytes], k: int, where: str | None = None
) -> list[Any]:
    index = SimilarityIndex.open(db, "products")
    vectors = embed_queries(reference, index.meta, data)  # [Q, D]
    return [[h.to_dict() for h in index.search(v, k, where)] for v in vectors]


def assert_same_hits(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert [h["id"] for h in got] == [h["id"] for h in expected]
    assert [h["metadata"] for h in got] == [h["metadata"] for h in expected]
    np.testing.assert_allclose([h["score"] for h in got], [h["score"] for h in expected], rtol=0, atol=TOL)


# ------------------------------------------------------------------------------------------- in process
async def test_image_search_agrees_with_the_library(
    search_server: Server, photos: Photos, reference: Backbone, db: Path
) -> None:
    data = [photos.data["p01"], photos.data["p06"]]
    response = await search_server.client.post(
        "/v1/search", files=[("image", ("a.jpg", d, "image/jpeg")) for d in data], data={"k": "4"}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["index"], body["k"], [q["index"] for q in body["data"]]) == ("products", 4, [0, 1])
    for query, hits, own in zip(
        body["data"], expected_hits(reference, db, data, 4), ("p01", "p06"), strict=True
    ):
        assert_same_hits(query["results"], hits)
        assert query["results"][0]["id"] == own
        assert query["results"][0]["score"] == pytest.approx(1.0, abs=TOL)
    assert body["provenance"] == {
        "index": "products",
        "model": "tiny",
        "revision": reference.checkpoint.revision,
        "preprocess_hash": reference.preprocess_config.hash(),
        "pooling": "cls",
        "layers": None,
        "size": None,
        "policy": "crop",
        "normalized": False,
        "metric": "cosine",
        "ann": False,
        "precision": "float32",
        "precision_cosine": None,
        "model_precision": "float32",
        "index_precision": "float32",
        "preset": "default-v3",
    }


async def test_json_base64_and_vector_queries(
    search_server: Server, photos: Photos, reference: Backbone, db: Path, images: Images
) -> None:
    where = "brand = 'globex'"
    response = await search_server.client.post(
        "/v1/search", json={"images": [{"base64": images.b64(photos.data["p03"])}], "k": 3, "where": where}
    )
    assert response.status_code == 200, response.text
    [query] = response.json()["data"]
    [expected] = expected_hits(reference, db, [photos.data["p03"]], 3, where)
    assert_same_hits(query["results"], expected)
    assert {h["metadata"]["brand"] for h in query["results"]} == {"globex"} and len(query["results"]) == 3

    index = SimilarityIndex.open(db, "products")
    vector = embed_queries(reference, index.meta, [photos.data["p05"]])[0]
    response = await search_server.client.post(
        "/v1/search", json={"vector": vector.tolist(), "index": "products", "k": 2}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert_same_hits(body["data"][0]["results"], [h.to_dict() for h in index.search(vector, 2)])
    assert body["data"][0]["results"][0]["id"] == "p05"
    assert body["provenance"]["precision"] is None


async def test_top_k_is_an_alias_of_k(
    search_server: Server, err: Any, images: Images, photos: Photos
) -> None:
    client = search_server.client
    vector = {"vector": [1.0] * 32}
    by_k = (await client.post("/v1/search", json={**vector, "k": 3})).json()["data"]
    by_top_k = await client.post("/v1/search", json={**vector, "top_k": 3})
    assert by_top_k.status_code == 200, by_top_k.text
    assert by_top_k.json()["data"] == by_k and len(by_k[0]["results"]) == 3
    form = await client.post(
        "/v1/search", files={"image": photos.data["p01"]}, data={"top_k": "2"}
    )  # a form field too
    assert form.status_code == 200, form.text
    assert len(form.json()["data"][0]["results"]) == 2
    both = await client.post("/v1/search", json={**vector, "k": 3, "top_k": 2})
    assert both.status_code == 422
    assert err(both) == {
        "code": "invalid_request",
        "message": "give 'k' or its alias 'top_k', not both",
    }


async def test_indexes_lists_rows_and_metadata(search_server: Server, db: Path) -> None:
    index = SimilarityIndex.open(db, "products")
    response = await search_server.client.get("/v1/indexes")
    assert response.status_code == 200
    assert response.json() == {
        "object": "list",
        "data": [
            {
                "name": "products",
                "model": "tiny",
                "db": str(db),
                "table": "products",
                "rows": 8,
                "metric": "cosine",
                "ann": False,
                "ann_threshold": 100_000,
                "metadata_columns": ["brand"],
                "meta": index.meta.to_dict(),
            }
        ],
    }


async def test_rows_added_after_start_are_searched(
    serve: OpenServer, indexed: Indexed, photos: Photos, tiny_path: Path, tmp_path: Path
) -> None:
    build_index(indexed.catalog, tmp_path / "db", "t")
    async with serve(indexes={"live": f"{tmp_path / 'db'}:t"}) as server:
        query = {"files": [("image", ("q.jpg", photos.data["p09"], "image/jpeg"))], "data": {"k": "1"}}
        before = (await server.client.post("/v1/search", **query)).json()["data"][0]["results"][0]
        assert before["id"] != "p09"
        (tmp_path / "more").mkdir()
        add_catalog(embed_catalog(photos, ["p08", "p09"], tmp_path / "more", tiny_path), tmp_path / "db", "t")
        after = (await server.client.post("/v1/search", **query)).json()["data"][0]["results"][0]
        assert (after["id"], after["score"]) == ("p09", pytest.approx(1.0, abs=TOL))
        listed = (await server.client.get("/v1/indexes")).json()["data"]
        assert [(i["name"], i["rows"]) for i in listed] == [("live", 10)]


async def test_error_bodies(search_server: Server, err: Any, images: Images, photos: Photos) -> None:
    client = search_server.client
    cases: list[tuple[dict[str, Any], int, dict[str, Any]]] = [
        (
            {"json": {"vector": [0.0] * 32, "index": "nope"}},
            404,
            {"code": "index_not_found", "message": "index 'nope' is not served; served: products"},
        ),
        (
            {"json": {"vector": [0.0] * 32, "k": 0}},
            422,
            {"code": "invalid_request", "message": "k: Input should be greater than or equal to 1"},
        ),
        (
            {"json": {"vector": [0.0] * 32, "k": 1001}},
            422,
            {"code": "invalid_request", "message": "k: Input should be less than or equal to 1000"},
        ),
        (
            {"json": {"vector": [1.0, 2.0, 3.0]}},
            422,
            {
                "code": "invalid_vector",
                "message": "the query vector has shape [3]; index 'products' holds 32-dimensional vectors",
            },
        ),
        (
            {"json": {"vector": [1.0] * 32, "images": [{"base64": images.b64(photos.data["p00"])}]}},
            422,
            {"code": "invalid_request", "message": "send either 'images' or 'vector' (one of them)"},
        ),
        (
            {"json": {"vector": [1.0] * 32, "where": "   "}},
            422,
            {"code": "invalid_filter", "message": "the where filter is empty"},
        ),
        (
            {"files": [("image", ("a.jpg", photos.data["p00"], "image/jpeg"))], "data": {"model": "tiny"}},
            422,
            {
                "code": "invalid_request",
                "message": "unknown form field 'model': images go in parts named 'image' "
                "(curl -F image=@photo.jpg); options: index, k, where, nprobes, threshold",
            },
        ),
        (
            {"files": [("image", ("a.jpg", b"not an image at all", "image/jpeg"))]},
            400,
            {
                "code": "not_an_image",
                "message": "the bytes are not an image in a recognised format "
                "(accepted: JPEG, PNG, WEBP, GIF, BMP, TIFF)",
                "index": 0,
            },
        ),
        (
            {"content": b"hello", "headers": {"content-type": "text/plain"}},
            415,
            {
                "code": "unsupported_media_type",
                "message": "send the request as multipart/form-data or application/json",
            },
        ),
    ]
    for kwargs, status, body in cases:
        response = await client.post("/v1/search", **kwargs)
        assert (response.status_code, err(response)) == (status, body), kwargs

    filter_errors = {
        "1/0 = 1": "invalid where filter: Query Execution error: Error applying filter expression to batch: "
        "Arrow error: Divide by zero error",
        "CAST(brand AS INT) > 5": "invalid where filter: Query Execution error: Error applying filter "
        "expression to batch: Arrow error: Cast error: Cannot cast string 'acme' to value of Int32 type",
        "brand = 'acme'; DROP TABLE products": "invalid where filter: ';' is not allowed outside a quoted "
        "string; give one SQL predicate, e.g. brand = 'acme' AND price < '10'",
    }
    for where, message in filter_errors.items():
        response = await client.post("/v1/search", json={"vector": [1.0] * 32, "where": where})
        assert (response.status_code, err(response)) == (422, {"code": "invalid_filter", "message": message})
    zero = "the query vector has zero (or subnormal) length: it has no direction to compare by cosine"
    non_finite = "the query vector holds non-finite values (NaN or infinity)"
    for content, message in [
        (json.dumps({"vector": [0.0] * 32}), zero),
        (json.dumps({"vector": [1e-45] * 32}), zero),
        ('{"vector": [NaN' + ", 1.0" * 31 + "]}", non_finite),
        ('{"vector": [1e39' + ", 1.0" * 31 + "]}", non_finite),  # beyond float32
    ]:
        response = await client.post(
            "/v1/search", content=content, headers={"content-type": "application/json"}
        )
        assert (response.status_code, err(response)) == (422, {"code": "invalid_vector", "message": message})

    response = await client.post("/v1/search", json={"vector": [1.0] * 32, "where": "brnd = 'acme'"})
    error = err(response)
    assert (response.status_code, error["code"]) == (422, "invalid_filter")
    assert error["message"].startswith("invalid where filter: Schema error: No field named brnd.")
    assert (await client.get("/ready")).status_code == 200  # none of it hurt the server


async def test_without_indexes_search_is_404(serve: OpenServer, err: Any) -> None:
    async with serve() as server:
        response = await server.client.post("/v1/search", json={"vector": [1.0] * 32})
        assert response.status_code == 404
        assert err(response) == {
            "code": "index_not_found",
            "message": "no index is served: start the server with --index NAME=DB_PATH:TABLE",
        }
        assert (await server.client.get("/v1/indexes")).json() == {"object": "list", "data": []}


async def test_an_index_no_served_model_matches_stops_start_up(
    serve: OpenServer, reference: Backbone, tmp_path: Path
) -> None:
    meta = CatalogMeta(
        "other-model", "rev-other", "pre-other", "cls", None, None, "crop", False, 32, "float32"
    )
    create_table(tmp_path / "db", "t", ["a"], np.ones((1, 32), np.float32), meta, options=IndexOptions())
    with pytest.raises(SettingsError) as caught:
        async with serve(indexes={"foreign": f"{tmp_path / 'db'}:t"}):
            pass
    assert str(caught.value) == (
        "index 'foreign' was embedded with model 'other-model' (revision rev-other, preprocess pre-other), "
        f"which is not served; served: tiny (revision {reference.checkpoint.revision}, preprocess "
        f"{reference.preprocess_config.hash()}). Serve that checkpoint with --model, or rebuild the index "
        "with a served model"
    )


# ------------------------------------------------------------------------------------------- settings
def test_index_flag_and_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_index_args(["p=/data/db:products", "q=C:/x/db:t"]) == {
        "p": "/data/db:products",
        "q": "C:/x/db:t",
    }
    monkeypatch.setenv("VITEMBED_INDEXES", '{"products": "/data/db:products"}')
    assert ServiceSettings().indexes == {"products": "/data/db:products"}
    monkeypatch.delenv("VITEMBED_INDEXES")
    with pytest.raises(ValidationError, match="expected DB_PATH:TABLE"):
        ServiceSettings(indexes={"p": "/data/db"})
    for flag, message in [
        ("products", "--index 'products': expected NAME=DB_PATH:TABLE"),
        ("p=/data/db", "index '/data/db': expected DB_PATH:TABLE, e.g. /data/lancedb:products"),
    ]:
        capsys.readouterr()
        assert main(["serve", "--index", flag]) == 2
        assert capsys.readouterr().err == f"vitembed serve: error: {message}\n"


# ------------------------------------------------------------------------------------------- real process
def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITEMBED_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VITEMBED_TORCH_THREADS="1")
    return env


def _serve_argv(tiny_path: Path, port: int, index: str) -> list[str]:
    return [
        sys.executable, "-m", "vitembed", "serve", "--model", f"tiny={tiny_path}", "--host", HOST,
        "--port", str(port), "--precision", "float32", "--index", index,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def served_process(db: Path, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``vitembed serve --index products=DB:products`` on loopback; its URL once ``/ready`` answers 200."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve-search") / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _serve_argv(tiny_path, port, f"products={db}:products"),
            cwd=ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vitembed serve did not become ready:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/ready", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(35)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_real_server_agrees_with_the_cli(
    served_process: str, db: Path, photos: Photos, tiny_path: Path
) -> None:
    files = [photos.folder / "p02.jpg", photos.folder / "p09.jpg"]  # p09 is not in the index
    with httpx.Client(base_url=served_process, timeout=30, trust_env=False) as client:
        response = client.post(
            "/v1/search",
            files=[("image", (f.name, f.read_bytes(), "image/jpeg")) for f in files],
            data={"k": "5", "where": "brand = 'acme'"},
        )
    assert response.status_code == 200, response.text
    cli = subprocess.run(
        [sys.executable, "-m", "vitembed", "search", "--db", str(db), "--table", "products", "--model",
         str(tiny_path), "--k", "5", "--where", "brand = 'acme'", "--json", *map(str, files)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    from_cli = json.loads(cli.stdout)["queries"]
    served = response.json()["data"]
    assert len(served) == len(from_cli) == 2
    for got, expected in zip(served, from_cli, strict=True):
        assert len(got["results"]) == 4  # p00, p02, p04, p06: the acme rows
        assert_same_hits(got["results"], expected["results"])
    assert served[0]["results"][0]["id"] == "p02"


def test_cli_search_through_a_running_server_equals_the_local_one(
    served_process: str, db: Path, photos: Photos, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [str(photos.folder / "p02.jpg"), str(photos.folder / "p09.jpg")]
    search = ["search", "--db", str(db), "--table", "products", "--k", "3", "--json", *files]
    capsys.readouterr()
    assert main([*search, "--server", served_process]) == 0  # embedded by the server: no model loaded here
    remote = json.loads(capsys.readouterr().out)["queries"]
    assert main([*search, "--model", str(tiny_path)]) == 0
    local = json.loads(capsys.readouterr().out)["queries"]
    for got, expected in zip(remote, local, strict=True):
        assert_same_hits(got["results"], expected["results"])
    assert remote[0]["results"][0]["id"] == "p02"


def test_cli_search_server_without_the_table_s_model_is_one_line(
    served_process: str,
    make_checkpoint: Any,
    photos: Photos,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = make_checkpoint("dinov2", seed=3)  # another model's table
    build_index(embed_catalog(photos, ["p00", "p01"], tmp_path, other), tmp_path / "db", "other")
    capsys.readouterr()
    argv = ["search", "--db", str(tmp_path / "db"), "--table", "other", str(photos.folder / "p00.jpg")]
    assert main([*argv, "--server", served_process]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"vitembed search: error: the server at {served_process} serves no model with the table's "
    )
    assert "(it serves: tiny (local-" in err and err.count("\n") == 1


def test_real_server_refuses_an_index_of_another_model(tiny_path: Path, tmp_path: Path) -> None:
    meta = CatalogMeta(
        "other-model", "rev-other", "pre-other", "cls", None, None, "crop", False, 32, "float32"
    )
    create_table(tmp_path / "db", "t", ["a"], np.ones((1, 32), np.float32), meta)
    started = time.monotonic()
    done = subprocess.run(
        _serve_argv(tiny_path, _free_port(), f"foreign={tmp_path / 'db'}:t"),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        "vitembed serve: error: index 'foreign' was embedded with model 'other-model' (revision rev-other, "
        "preprocess pre-other), which is not served; served: tiny (revision local-"
    )
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert time.monotonic() - started < 60


async def test_data_uri_base64_and_nprobes(
    search_server: Server, photos: Photos, reference: Backbone, db: Path, images: Images
) -> None:
    uri = "data:image/jpeg;base64," + images.b64(photos.data["p04"])
    response = await search_server.client.post(
        "/v1/search", json={"images": [{"base64": uri}], "k": 2, "nprobes": 5}
    )
    assert response.status_code == 200, response.text
    [expected] = expected_hits(reference, db, [photos.data["p04"]], 2)
    assert_same_hits(response.json()["data"][0]["results"], expected)
    assert expected[0]["id"] == "p04"


async def test_a_table_rebuilt_or_dropped_under_the_server(
    serve: OpenServer, indexed: Indexed, err: Any, tmp_path: Path
) -> None:
    """Rebuilt with other options by a served model: the new version is served at once (hot swap, no
    restart). Rebuilt by a model that is not served: 409. Dropped: 503, until it is built again."""
    db = tmp_path / "db"
    build_index(indexed.catalog, db, "t")
    catalog = read_catalog(indexed.catalog)
    async with serve(indexes={"live": f"{db}:t"}) as server:
        query = {"json": {"vector": catalog.embeddings[0].tolist(), "k": 1}}

        async def top(body: dict[str, Any]) -> str:
            response = await server.client.post("/v1/search", **body)
            assert response.status_code == 200, response.text
            return str(response.json()["data"][0]["results"][0]["id"])

        assert await top(query) == "p00"
        other = replace(catalog.meta, pooling="mean", dim=16)
        create_table(db, "t", ["a", "b"], np.eye(2, 16, dtype=np.float32), other, overwrite=True)
        assert await top({"json": {"vector": [0.0, 1.0] + [0.0] * 14, "k": 1}}) == "b"
        (card,) = (await server.client.get("/v1/indexes")).json()["data"]
        assert (card["rows"], card["meta"]["pooling"], card["meta"]["dim"]) == (2, "mean", 16)

        foreign = replace(other, revision="not-served")
        create_table(db, "t", ["z"], np.ones((1, 16), np.float32), foreign, overwrite=True)
        for response in (
            await server.client.post("/v1/search", json={"vector": [1.0] * 16, "k": 1}),
            await server.client.get("/v1/indexes"),
        ):
            assert response.status_code == 409
            assert err(response) == {
                "code": "index_changed",
                "message": "index 'live' was rebuilt in a way the served models cannot query; rebuild it "
                f"with a served model, or serve its model (table 't' in {db} was rebuilt with other options "
                f"since it was opened (revision: {catalog.meta.revision!r} -> 'not-served'); reopen it)",
            }
        connect(db).drop_table("t")
        response = await server.client.post("/v1/search", json={"vector": [1.0] * 16, "k": 1})
        assert (response.status_code, err(response)) == (
            503,
            {
                "code": "index_dropped",
                "message": f"index 'live' ({db}:t) was dropped or moved; it is served again once the "
                "table is rebuilt there",
            },
        )
        assert (await server.client.get("/ready")).status_code == 200
        build_index(indexed.catalog, db, "t")  # back, as the index Job leaves it
        assert await top(query) == "p00"


async def test_search_past_the_deadline_is_504(serve: OpenServer, db: Path, err: Any) -> None:
    async with serve(indexes={"products": f"{db}:products"}, request_timeout_s=1e-9) as server:
        response = await server.client.post("/v1/search", json={"vector": [1.0] * 32})
        assert response.status_code == 504
        assert err(response) == {"code": "deadline_exceeded", "message": "no result within 1e-09 s"}
        assert (await server.client.get("/ready")).status_code == 200


async def test_default_precision_server_still_finds_each_image_first(
    serve: OpenServer, db: Path, photos: Photos
) -> None:
    """``--precision auto`` (bfloat16 where the hardware has it) against a float32 index."""
    async with serve(indexes={"products": f"{db}:products"}, precision="auto") as server:
        for item in ("p00", "p03", "p07"):
            files = [("image", ("q.jpg", photos.data[item], "image/jpeg"))]
            response = await server.client.post("/v1/search", files=files, data={"k": "2"})
            assert response.status_code == 200, response.text
            body = response.json()
            top = body["data"][0]["results"][0]
            assert top["id"] == item and top["score"] >= 0.999
            provenance = body["provenance"]
            assert provenance["model_precision"] in ("float32", "bfloat16")
            assert provenance["precision"] == provenance["model_precision"]
            assert provenance["index_precision"] == "float32"


async def test_an_index_over_the_token_limit_stops_start_up(
    serve: OpenServer, indexed: Indexed, tmp_path: Path
) -> None:
    catalog = read_catalog(indexed.catalog)
    meta = replace(catalog.meta, size=[140, 140])  # 10 x 10 patches of 14 = 100 tokens
    create_table(tmp_path / "db", "t", catalog.ids, catalog.embeddings, meta)
    with pytest.raises(SettingsError) as caught:
        async with serve(indexes={"big": f"{tmp_path / 'db'}:t"}, max_tokens_per_image=64):
            pass
    assert str(caught.value) == (
        "index 'big' was embedded at size 140x140, which gives 100 patch tokens, over the server's limit "
        "of 64 (attention cost grows with tokens²); raise the limit (VITEMBED_MAX_TOKENS_PER_IMAGE) or "
        "rebuild the index at a smaller size"
    )


async def test_cli_and_server_on_an_index_with_non_default_options(
    serve: OpenServer, photos: Photos, tiny_path: Path, reference: Backbone, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """mean pooling over both blocks at 42x70, normalised: queries are embedded exactly so, by both."""
    ids = list(photos.data)[:6]
    manifest = photos.manifest(ids, tmp_path / "m.csv")
    argv = ["embed-catalog", str(manifest), "--out", str(tmp_path / "cat"), "--model", f"tiny={tiny_path}",
            "--precision", "float32", "--pooling", "mean", "--layers", "0", "1", "--size", "42", "70",
            "--normalize"]  # fmt: skip
    assert main(argv) == 0
    build_index(tmp_path / "cat", tmp_path / "db", "odd", metric="dot")
    meta = SimilarityIndex.open(tmp_path / "db", "odd").meta
    assert (meta.pooling, meta.layers, meta.size, meta.normalized, meta.dim) == (
        "mean",
        [0, 1],
        [42, 70],
        True,
        64,
    )
    capsys.readouterr()
    files = [photos.folder / f"{item}.jpg" for item in ("p01", "p04")]
    search = ["search", "--db", str(tmp_path / "db"), "--table", "odd", "--model", str(tiny_path), "--k", "3"]
    assert main([*search, "--json", *map(str, files)]) == 0
    from_cli = json.loads(capsys.readouterr().out)["queries"]
    async with serve(indexes={"odd": f"{tmp_path / 'db'}:odd"}) as server:
        response = await server.client.post(
            "/v1/search",
            files=[("image", (f.name, f.read_bytes(), "image/jpeg")) for f in files],
            data={"k": "3"},
        )
    assert response.status_code == 200, response.text
    body = response.json()
    for got, expected, own in zip(body["data"], from_cli, ("p01", "p04"), strict=True):
        assert_same_hits(got["results"], expected["results"])
        assert got["results"][0]["id"] == own
        assert got["results"][0]["score"] == pytest.approx(1.0, abs=TOL)
    assert body["provenance"] == {
        "index": "odd",
        "model": "tiny",
        "revision": reference.checkpoint.revision,
        "preprocess_hash": reference.preprocess_config.hash(),
        "pooling": "mean",
        "layers": [0, 1],
        "size": [42, 70],
        "policy": "crop",
        "normalized": True,
        "metric": "dot",
        "ann": False,
        "precision": "float32",
        "precision_cosine": None,
        "model_precision": "float32",
        "index_precision": "float32",
        "preset": "default-v3",
    }


async def test_threshold_answers_is_this_a_near_duplicate(
    search_server: Server, photos: Photos, reference: Backbone, db: Path
) -> None:
    """threshold= keeps only hits scoring at least it; each query says whether one is left."""
    data = [photos.data["p02"], photos.data["p04"]]
    [first, second] = expected_hits(reference, db, data, 5)
    cut = (first[1]["score"] + first[2]["score"]) / 2  # between the 2nd and 3rd hit of the first query
    response = await search_server.client.post(
        "/v1/search", files=[("image", d) for d in data], data={"k": "5", "threshold": str(cut)}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["threshold"] == pytest.approx(cut)
    assert_same_hits(body["data"][0]["results"], first[:2])
    assert body["data"][0]["near_duplicate"] is True
    kept = [h for h in second if h["score"] >= cut]
    assert_same_hits(body["data"][1]["results"], kept)
    assert body["data"][1]["near_duplicate"] is bool(kept)
    none = await search_server.client.post(
        "/v1/search",
        json={"vector": [1.0] + [0.0] * (len(reference.embed(data[:1])[0]) - 1), "threshold": 1.5},
    )
    assert none.status_code == 200, none.text
    assert none.json()["data"][0] == {"index": 0, "results": [], "near_duplicate": False}
