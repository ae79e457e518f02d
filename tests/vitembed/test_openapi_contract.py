"""The OpenAPI document is the contract: ``schemathesis run --checks all`` against a real ``vitembed serve``
(tiny model, a LanceDB index and a linear head, 127.0.0.1), with and without an API key, finds no failure
on any operation of the document; every operation gets at least 25 requests (those without inputs: what
their few distinct requests make) and at least one 2xx from schema-generated data (the image formats of
the schema produce real images: tests/vitembed/contract/schemathesis_hooks.py; the index's item ids come
from the config's dictionaries, as a client that searched would know them). Plus the schema's own facts:
security only with a key, the statuses listed, and infinity's ``modality`` field.

The explorer page (``/``, ``/explore``, ``/explore/assets/*``) is not in the document
(``include_in_schema=False``): it is HTML and static files for a browser, not an API."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from heads_synthetic import make_labelled_folder
from PIL import Image
from test_server_process import ServerProcess, error_of, server_env, start_server
from vitembed.cli.main import main

from vit_backbone import Backbone
from vit_backbone.heads import TrainOptions, save_head, train_head
from vit_backbone.preprocess import RESIZE_POLICIES

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency: pip install -e '.[dev]'")

CONTRACT = Path(__file__).resolve().parent / "contract"
EXPECTED = {
    "GET /health",
    "GET /ready",
    "GET /metrics",
    "GET /v1/models",
    "POST /v1/embed",
    "POST /v1/embeddings",
    "POST /v1/search",
    "GET /v1/indexes",
    "POST /v1/classify",
    "POST /v1/patch-features",
    "POST /v1/patch-similarity",
    "GET /v1/indexes/{index}/thumbnail",
}
KEY = "contract-test-key"
WITHOUT_INPUTS = {"GET /health", "GET /ready", "GET /metrics", "GET /v1/models", "GET /v1/indexes"}


@pytest.fixture(scope="module")
def served_data(tiny_path: Path, reference: Backbone, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``--index photos=...`` over four noise JPEGs p0.jpg..p3.jpg (the ids schemathesis.toml names) and
    ``--head shapes=...``, a linear head trained on generated shapes: the flags of the test servers."""
    root = tmp_path_factory.mktemp("contract-data")
    photos = root / "photos"
    photos.mkdir()
    for i in range(4):
        pixels = np.random.default_rng(i).integers(0, 256, (64 + 8 * i, 80, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(photos / f"p{i}.jpg")
    tiny = f"tiny={tiny_path}"
    embed = [
        "embed-catalog",
        str(photos),
        "--out",
        str(root / "cat"),
        "--model",
        tiny,
        "--precision",
        "float32",
    ]
    assert main(embed) == 0
    assert main(["index", "build", str(root / "cat"), "--db", str(root / "db"), "--table", "photos"]) == 0
    labelled = make_labelled_folder(root / "labelled", per_class=4)
    head = train_head(reference, labelled, TrainOptions(kind="linear", pooling="mean", layers=(0, 1))).head
    save_head(head, root / "shapes.safetensors")
    return ["--index", f"photos={root / 'db'}:photos", "--head", f"shapes={root / 'shapes.safetensors'}"]


@pytest.fixture(scope="module")
def open_server(
    tiny_path: Path, served_data: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(tiny_path, tmp_path_factory.mktemp("serve-contract"), *served_data)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(
    tiny_path: Path, served_data: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The API key has no flag (it would show in the process list): it goes in VITEMBED_API_KEY."""
    server = start_server(
        tiny_path, tmp_path_factory.mktemp("serve-contract-key"), *served_data, env={"VITEMBED_API_KEY": KEY}
    )
    yield server
    server.stop()


Statuses = dict[str, collections.Counter[int]]


def run_schemathesis(server: ServerProcess, report_dir: Path, *headers: str) -> Statuses:
    """Run the CLI; returns the statuses each operation answered (from the NDJSON report)."""
    command = [
        sys.executable, "-m", "schemathesis.cli",
        "--config-file", str(CONTRACT / "schemathesis.toml"),
        "run", f"{server.url}/openapi.json",
        "--checks", "all",
        "--max-examples", "25",
        "--seed", "12",
        "--generation-database", "none",
        "--no-color",
        "--report", "ndjson", "--report-dir", str(report_dir),
        *[arg for header in headers for arg in ("-H", header)],
    ]  # fmt: skip
    env = {**server_env(), "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(CONTRACT)}
    done = subprocess.run(command, cwd=CONTRACT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    statuses: Statuses = collections.defaultdict(collections.Counter)
    (report,) = report_dir.glob("*.ndjson")
    for line in report.read_text().splitlines():
        event: dict[str, Any] = json.loads(line)
        finished = event.get("ScenarioFinished")
        if not finished:
            continue
        recorder = finished.get("recorder", {})
        for interaction in recorder.get("interactions", {}).values():
            if interaction.get("response"):
                statuses[recorder["label"]][interaction["response"]["status_code"]] += 1
    return statuses


def check_coverage(statuses: Statuses) -> None:
    statuses.pop("Stateful tests", None)  # sequences of the operations above, through the schema's links
    print({label: dict(counts) for label, counts in statuses.items()})  # shown with -s, and on failure
    assert set(statuses) == EXPECTED, statuses
    for label, counts in statuses.items():
        if label not in WITHOUT_INPUTS:  # an operation without parameters or body has few distinct requests
            assert sum(counts.values()) >= 25, (label, counts)
        assert any(200 <= status < 300 for status in counts), (label, counts)


@pytest.mark.slow  # about a minute each (12 operations, 25 examples), plus the servers' start
def test_schemathesis_finds_no_failure_without_an_api_key(open_server: ServerProcess, tmp_path: Path) -> None:
    check_coverage(run_schemathesis(open_server, tmp_path))


@pytest.mark.slow  # about a minute each (12 operations, 25 examples), plus the servers' start
def test_schemathesis_finds_no_failure_with_an_api_key(keyed_server: ServerProcess, tmp_path: Path) -> None:
    check_coverage(run_schemathesis(keyed_server, tmp_path, f"Authorization: Bearer {KEY}"))


def test_security_and_statuses_follow_the_configuration(
    open_server: ServerProcess, keyed_server: ServerProcess
) -> None:
    with open_server.client() as client:
        unkeyed = client.get("/openapi.json").json()
    with keyed_server.client() as client:
        keyed = client.get("/openapi.json").json()
    assert "securitySchemes" not in unkeyed["components"]
    assert keyed["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for schema, has_key in ((unkeyed, False), (keyed, True)):
        for path, item in schema["paths"].items():
            for method, operation in item.items():
                where = f"{method.upper()} {path}"
                assert ("security" in operation) == (has_key and path.startswith("/v1/")), where
                assert ("401" in operation["responses"]) == (has_key and path.startswith("/v1/")), where
                assert "500" in operation["responses"], where
                if path.startswith("/v1/") and method == "post":
                    for status in ("400", "408", "413", "415", "422", "429", "503", "504"):
                        assert status in operation["responses"], (where, status)
                    assert operation["responses"]["429"]["headers"]["Retry-After"]["required"] is True
                if method == "get":  # no body: no body statuses, no admission
                    for status in ("400", "408", "413", "415", "429"):
                        assert status not in operation["responses"], (where, status)
    thumbnail = unkeyed["paths"]["/v1/indexes/{index}/thumbnail"]["get"]["responses"]
    assert sorted(thumbnail) == ["200", "404", "409", "422", "500", "503", "504"]
    assert sorted(unkeyed["paths"]["/v1/indexes"]["get"]["responses"]) == ["200", "409", "500", "503", "504"]
    for path, most in (("/v1/classify", 64), ("/v1/search", 64), ("/v1/patch-features", 1)):
        content = unkeyed["paths"][path]["post"]["requestBody"]["content"]
        form = content["multipart/form-data"]
        assert form["schema"]["required"][0] == "image" and form["schema"]["additionalProperties"] is False
        assert (
            form["schema"]["properties"]["image"]["minItems"],
            form["schema"]["properties"]["image"]["maxItems"],
        ) == (1, most)
        assert form["encoding"]["image"]["contentType"].startswith("image/jpeg")
    features = unkeyed["paths"]["/v1/patch-features"]["post"]["requestBody"]["content"]["application/json"]
    assert features["schema"]["properties"]["images"]["maxItems"] == 1
    assert features["schema"]["properties"]["policy"]["anyOf"][0]["enum"] == list(RESIZE_POLICIES)
    assert {"crop", "squash", "pad", "dynamic"} <= set(RESIZE_POLICIES)
    embed = unkeyed["paths"]["/v1/embed"]["post"]
    pooling = next(p for p in embed["parameters"] if p["name"] == "pooling")["schema"]
    assert {"cls", "mean", "patch"} <= set(pooling["enum"])
    assert unkeyed["components"]["schemas"]["EmbedJsonRequest"]["properties"]["images"]["minItems"] == 1
    body = unkeyed["components"]["schemas"]["OpenAIEmbeddingRequest"]["properties"]
    assert body["input"]["anyOf"][1]["minItems"] == 1 and body["input"]["anyOf"][1]["maxItems"] == 64
    assert body["modality"]["anyOf"][0]["enum"] == ["image"]


def test_infinity_modality_image_is_accepted_and_text_refused(
    open_server: ServerProcess, images: Images
) -> None:
    uri = images.data_uri(images.jpeg())
    with open_server.client() as client:
        accepted = client.post("/v1/embeddings", json={"input": [uri], "modality": "image"})
        assert accepted.status_code == 200, accepted.text
        refused = client.post("/v1/embeddings", json={"input": ["a photo of a cat"], "modality": "text"})
    assert refused.status_code == 422
    assert error_of(refused) == {
        "code": "modality_unsupported",
        "message": "modality 'text' is not served: these models embed images only; send images as "
        'data:image/...;base64, URIs with "modality": "image" (or leave modality out)',
    }


DEADLINE_ROUTES = {
    "POST /v1/embed",
    "POST /v1/embeddings",
    "POST /v1/search",
    "POST /v1/classify",
    "POST /v1/patch-features",
    "POST /v1/patch-similarity",
    "GET /v1/indexes/{index}/thumbnail",
}


def test_the_deadline_header_is_declared_where_it_is_honoured(
    open_server: ServerProcess, images: Images
) -> None:
    """Declared on exactly the operations that read it: each of them refuses a malformed value with 422
    ``invalid_timeout``; the others ignore the header."""
    with open_server.client() as client:
        schema = client.get("/openapi.json").json()
        declared = set()
        for path, item in schema["paths"].items():
            for method, operation in item.items():
                names = [p for p in operation.get("parameters", []) if p["name"] == "X-Request-Timeout"]
                if names:
                    (parameter,) = names
                    assert parameter["in"] == "header" and parameter["required"] is False
                    assert parameter["schema"] == {"type": "number", "exclusiveMinimum": 0, "examples": [2.5]}
                    declared.add(f"{method.upper()} {path}")
        assert declared == DEADLINE_ROUTES
        bad = {"X-Request-Timeout": "soon"}
        jpeg = images.jpeg()
        answers = {
            "POST /v1/embed": client.post("/v1/embed", files={"image": jpeg}, headers=bad),
            "POST /v1/embeddings": client.post(
                "/v1/embeddings", json={"input": images.data_uri(jpeg)}, headers=bad
            ),
            "POST /v1/search": client.post("/v1/search", files={"image": jpeg}, headers=bad),
            "POST /v1/classify": client.post("/v1/classify", files={"image": jpeg}, headers=bad),
            "POST /v1/patch-features": client.post("/v1/patch-features", files={"image": jpeg}, headers=bad),
            "POST /v1/patch-similarity": client.post(
                "/v1/patch-similarity", files={"image": jpeg}, data={"row": "0", "col": "0"}, headers=bad
            ),
            "GET /v1/indexes/{index}/thumbnail": client.get(
                "/v1/indexes/photos/thumbnail", params={"id": "p0.jpg"}, headers=bad
            ),
        }
        for where, response in answers.items():
            assert response.status_code == 422, (where, response.text)
            assert error_of(response) == {
                "code": "invalid_timeout",
                "message": "X-Request-Timeout must be a positive number of seconds, e.g. 2.5",
            }, where
        for path in ("/v1/models", "/v1/indexes", "/health"):
            assert client.get(path, headers=bad).status_code == 200, path
        # a valid one is honoured on a declared route: served well within it
        assert client.post("/v1/embed", files={"image": jpeg}, headers={"X-Request-Timeout": "5"}).is_success


def test_the_npy_answer_headers_are_declared(open_server: ServerProcess, images: Images) -> None:
    """Every ``X-Vitembed-*`` header of a ``.npy`` answer (with a letterbox mask, so ``Valid`` too) is one
    the 200 of ``/v1/embed`` declares, and none of them is required (the JSON answer has none)."""
    with open_server.client() as client:
        declared = client.get("/openapi.json").json()["paths"]["/v1/embed"]["post"]["responses"]["200"]
        npy = client.post(
            "/v1/embed",
            files=[("image", images.jpeg(200, 60, 4)), ("image", images.png(56, 56, 5))],
            data={"pooling": "patch", "policy": "pad", "size": "56,56"},
            headers={"Accept": "application/x-npy"},
        )
        as_json = client.post("/v1/embed", files={"image": images.jpeg()})
    assert npy.status_code == 200, npy.text
    sent = {name.lower() for name in npy.headers if name.lower().startswith("x-vitembed-")}
    names = {name.lower(): spec for name, spec in declared["headers"].items()}
    assert "x-vitembed-valid" in sent and "x-vitembed-dim" in sent
    assert sent == set(names)  # this answer carries every one of them
    assert all(spec["required"] is False for spec in names.values())
    assert as_json.status_code == 200 and not any(
        h.lower().startswith("x-vitembed-") for h in as_json.headers
    )
