"""The OpenAPI document is the contract: ``schemathesis run --checks all`` against a real ``vitembed serve``
(tiny model, 127.0.0.1), with and without an API key, finds no failure; every tested operation gets at
least 25 requests and at least one 2xx from schema-generated data (the image formats of the schema produce
real images: tests/vitembed/contract/schemathesis_hooks.py). Plus the schema's own facts: security only
with a key, the statuses listed, and infinity's ``modality`` field."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_server_process import ServerProcess, error_of, server_env, start_server

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

pytest.importorskip("schemathesis", reason="schemathesis is a dev dependency: pip install -e '.[dev]'")

CONTRACT = Path(__file__).resolve().parent / "contract"
OPERATIONS = r"^/(health|ready|metrics|v1/models|v1/embeddings)$"
KEY = "contract-test-key"
WITH_INPUTS = {"POST /v1/embeddings"}


@pytest.fixture(scope="module")
def open_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tiny_path, tmp_path_factory.mktemp("serve-contract"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The API key has no flag (it would show in the process list): it goes in VITEMBED_API_KEY, which the
    shared starter builds from ``server_env``."""
    import test_server_process

    original = test_server_process.server_env
    test_server_process.server_env = lambda **extra: original(VITEMBED_API_KEY=KEY, **extra)
    try:
        server = start_server(tiny_path, tmp_path_factory.mktemp("serve-contract-key"))
    finally:
        test_server_process.server_env = original
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
        "--include-path-regex", OPERATIONS,
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
    expected = {"GET /health", "GET /ready", "GET /metrics", "GET /v1/models", "POST /v1/embeddings"}
    assert set(statuses) == expected, statuses
    for label, counts in statuses.items():
        if label in WITH_INPUTS:  # an operation without parameters or body has few distinct requests
            assert sum(counts.values()) >= 25, (label, counts)
        assert any(200 <= status < 300 for status in counts), (label, counts)


def test_schemathesis_finds_no_failure_without_an_api_key(open_server: ServerProcess, tmp_path: Path) -> None:
    check_coverage(run_schemathesis(open_server, tmp_path))


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
