"""Per-caller quotas in the app (an API keys file with two callers and ``VITEMBED_API_KEY``): who is let in,
the 429 ``quota_exceeded`` answer (body, ``Retry-After``), the request-head gate writing the same answer,
tokens given back when the server refuses the work itself, metrics by caller name, and the OpenAPI
document. The quota state is set through the app's own ``QuotaBook``, so nothing depends on timing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from vitembed.engine.engine import Engine
from vitembed.server.early_refusal import AdmissionGate
from vitembed.server.quotas import QuotaBook

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images, OpenServer, Server

pytestmark = pytest.mark.anyio

CAPPED = "capped-caller-key-0001"  # at most 2 images in flight
METERED = "metered-caller-key-003"  # a burst of 3 images, then 1 per 1000 s
FREE = "free-caller-key-000002"  # no limits
SINGLE = "the-single-api-key"  # VITEMBED_API_KEY: the caller "default"


def auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture(scope="module")
async def keyed(serve: OpenServer, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Server]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(
        json.dumps(
            {
                "capped": {"key": CAPPED, "max_images_in_flight": 2},
                "metered": {"key": METERED, "images_per_second": 0.001, "burst": 3},
                "free": {"key": FREE},
            }
        )
    )
    async with serve(api_keys_file=path, api_key=SINGLE, queue_size=4, max_images_per_request=4) as opened:
        yield opened


def book(server: Server) -> QuotaBook:
    quotas = server.state.quotas
    assert isinstance(quotas, QuotaBook)
    return quotas


async def embed(
    server: Server, key: str, images: Images, count: int = 1, headers: dict[str, str] | None = None
) -> httpx.Response:
    files = [("image", images.jpeg(seed=i)) for i in range(count)]
    return await server.client.post("/v1/embed", files=files, headers=auth(key, **(headers or {})))


async def test_every_key_is_let_in_and_a_wrong_one_is_401(keyed: Server, images: Images) -> None:
    for key in (FREE, SINGLE):
        assert (await embed(keyed, key, images)).status_code == 200
    for headers in ({"Authorization": f"Bearer {FREE}x"}, {"Authorization": f"Basic {FREE}"}, {}):
        refused = await keyed.client.post("/v1/embed", files=[("image", images.jpeg())], headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert refused.headers["www-authenticate"] == "Bearer"


async def test_a_capped_caller_gets_429_quota_exceeded_while_another_is_served(
    keyed: Server, images: Images
) -> None:
    capped = keyed.settings.callers.by_name["capped"]
    hold = book(keyed).acquire(capped, 2)  # its two images in flight
    try:
        refused = await embed(keyed, CAPPED, images, headers={"X-Request-ID": "q-1"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1" and refused.headers["x-request-id"] == "q-1"
        assert refused.json() == {
            "error": {
                "code": "quota_exceeded",
                "message": "caller 'capped' is over its quota: 2 of its max_images_in_flight=2 images are in "
                "flight; retry in 1 s",
                "request_id": "q-1",
                "limit": "max_images_in_flight",
            }
        }
        uri = "data:image/jpeg;base64," + images.b64(images.jpeg())
        openai = await keyed.client.post("/v1/embeddings", json={"input": [uri]}, headers=auth(CAPPED))
        assert openai.status_code == 429 and openai.json()["error"]["code"] == "quota_exceeded"
        for key in (FREE, SINGLE):  # the others are served as before
            served = await embed(keyed, key, images, 4)
            assert served.status_code == 200 and len(served.json()["data"]) == 4
        assert book(keyed).in_flight(capped) == 2  # refusals took nothing
    finally:
        hold.release()
    assert book(keyed).in_flight(capped) == 0
    too_many = await embed(keyed, CAPPED, images, 3)  # could never fit: 413, not a retry
    assert too_many.status_code == 413 and too_many.json()["error"]["code"] == "too_many_images"
    assert "max_images_in_flight=2" in too_many.json()["error"]["message"]


def let_through(gate: AdmissionGate, answer: bytes | dict[str, object] | None) -> bool:
    """The gate let the request through (a place held for it, given back here: no request follows)."""
    if isinstance(answer, dict):
        gate.request_done(answer)
    return not isinstance(answer, bytes)


async def test_the_head_gate_answers_exactly_as_the_app(keyed: Server, images: Images) -> None:
    capped = keyed.settings.callers.by_name["capped"]
    gate = keyed.state.admission_gate
    assert isinstance(gate, AdmissionGate) and gate.quotas is book(keyed)
    hold = book(keyed).acquire(capped, 2)
    try:
        app = await embed(keyed, CAPPED, images, headers={"X-Request-ID": "same-id"})
        raw = gate(
            "/v1/embed", b"", [(b"authorization", f"Bearer {CAPPED}".encode()), (b"x-request-id", b"same-id")]
        )
        # a wrong key and an uncapped caller are the app's to judge
        assert gate("/v1/embed", b"", [(b"authorization", b"Bearer nope")]) is None
        assert let_through(gate, gate("/v1/embed", b"", [(b"authorization", f"Bearer {FREE}".encode())]))
    finally:
        hold.release()
    assert raw is not None
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert lines[0] == "HTTP/1.1 429 Too Many Requests" and app.status_code == 429
    assert json.loads(body) == app.json()
    assert headers["retry-after"] == app.headers["retry-after"]
    assert headers["x-request-id"] == app.headers["x-request-id"] == "same-id"
    assert let_through(
        gate, gate("/v1/embed", b"", [(b"authorization", f"Bearer {CAPPED}".encode())])
    )  # room


async def test_tokens_come_back_when_the_server_refuses_the_work_itself(
    keyed: Server, images: Images
) -> None:
    """The metered caller's bucket holds 3 images and refills at one per 1000 s. With 2 of the queue's 4
    places taken, one image passes the early check but a 2-image request is refused by the server's
    admission (queue_full) after the quota charged it: its 2 tokens come back, so it is admitted later."""
    engine = keyed.state.engine
    assert isinstance(engine, Engine)
    reserved = engine.load("tiny").admit(2, 17, 30.0)
    try:
        full = await embed(keyed, METERED, images, 2)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    finally:
        reserved.release()
    served = await embed(keyed, METERED, images, 2)  # 3 tokens (the 2 came back): 1 left
    assert served.status_code == 200
    over = await embed(keyed, METERED, images, 2)  # 1 token left for a 2-image request
    assert over.status_code == 429 and over.json()["error"]["limit"] == "images_per_second"
    assert int(over.headers["retry-after"]) == 1000  # (2 - 1) tokens at 0.001 per second
    assert (
        await keyed.metric("vitembed_caller_requests_total", caller="metered", outcome="images_per_second")
        >= 1
    )
    assert await keyed.metric("vitembed_caller_images_in_flight", caller="metered") == 0
    text = (await keyed.client.get("/metrics")).text
    assert all(key not in text for key in (CAPPED, METERED, FREE, SINGLE))


async def test_openapi_shows_security_and_quota_exceeded_with_a_keys_file(keyed: Server) -> None:
    schema: dict[str, Any] = (await keyed.client.get("/openapi.json")).json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path in ("/v1/embed", "/v1/embeddings", "/v1/search", "/v1/classify", "/v1/patch-features"):
        operation = schema["paths"][path]["post"]
        assert "security" in operation and "401" in operation["responses"]
        assert "quota_exceeded" in operation["responses"]["429"]["description"], path
    assert "limit" in schema["components"]["schemas"]["ErrorDetail"]["properties"]
    assert "quota_exceeded" not in json.dumps(schema["paths"]["/v1/models"])
