"""Per-caller quotas against a real ``vitembed serve`` on 127.0.0.1, with an API keys file of three callers
and ``VITEMBED_API_KEY``: while the capped caller has its two images in flight, its next request gets 429
``quota_exceeded`` at once and the other callers are served; a caller over its rate gets 429 with the
``Retry-After`` of its bucket; a wrong key is 401 as before; the single key still works.

The server's batch timer is long (``--max-wait-ms 3000``, batches never fill), so an admitted request
stays in flight for three seconds: "the capped caller is at its quota" is a state that lasts, not a race
against a millisecond forward pass of the tiny model.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from test_server_process import ServerProcess, error_of, start_server

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

CAPPED = "capped-process-key-0001"
METERED = "metered-process-key-002"
FREE = "free-process-key-000003"
SINGLE = "single-process-key"
HELD_S = 3.0


@pytest.fixture(scope="module")
def quota_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("serve-quotas")
    keys = folder / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "capped": {"key": CAPPED, "max_images_in_flight": 2},
                "metered": {"key": METERED, "images_per_second": 0.01, "burst": 1},
                "free": {"key": FREE},
            }
        )
    )
    keys.chmod(0o600)
    server = start_server(
        tiny_path,
        folder,
        "--api-keys-file", str(keys),
        "--queue-size", "16",
        "--max-images-per-request", "4",
        "--max-batch-size", "32",
        "--max-wait-ms", str(int(HELD_S * 1000)),
        env={"VITEMBED_API_KEY": SINGLE},
    )  # fmt: skip
    yield server
    server.stop()


def post(client: httpx.Client, key: str, images: Images, count: int = 1) -> httpx.Response:
    files = [("image", images.jpeg(48, 48, seed)) for seed in range(count)]
    return client.post("/v1/embed", files=files, headers={"Authorization": f"Bearer {key}"})


def test_the_capped_caller_is_refused_while_the_others_are_served(
    quota_server: ServerProcess, images: Images
) -> None:
    held: dict[str, httpx.Response] = {}

    def hold_two() -> None:
        with quota_server.client(timeout=60.0) as client:
            held["answer"] = post(client, CAPPED, images, 2)

    holder = threading.Thread(target=hold_two)
    holder.start()
    try:
        deadline = time.monotonic() + HELD_S / 2
        while quota_server.metric("vitembed_caller_images_in_flight", caller="capped") < 2:
            assert time.monotonic() < deadline, "the capped caller's request never got in flight"
            time.sleep(0.02)
        with quota_server.client(timeout=60.0) as client:
            started = time.monotonic()
            refused = post(client, CAPPED, images)
            refused_s = time.monotonic() - started
            uri = images.data_uri(images.jpeg(48, 48, 7))
            openai = client.post(
                "/v1/embeddings", json={"input": [uri]}, headers={"Authorization": f"Bearer {CAPPED}"}
            )
            others = {key: post(client, key, images, 4) for key in (FREE, SINGLE)}  # served meanwhile
    finally:
        holder.join(60.0)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert error_of(refused) == {
        "code": "quota_exceeded",
        "message": "caller 'capped' is over its quota: 2 of its max_images_in_flight=2 images are in flight; "
        "retry in 1 s",
        "limit": "max_images_in_flight",
    }
    assert refused_s < HELD_S / 2  # refused at once, not after the held request
    assert openai.status_code == 429 and error_of(openai)["code"] == "quota_exceeded"
    for key, answer in others.items():
        assert answer.status_code == 200, (key, answer.text)
        assert len(answer.json()["data"]) == 4
    assert held["answer"].status_code == 200, held["answer"].text
    assert quota_server.metric("vitembed_caller_images_in_flight", caller="capped") == 0
    with quota_server.client(timeout=60.0) as client:
        assert post(client, CAPPED, images).status_code == 200  # its images answered: room again
    assert (
        quota_server.metric("vitembed_caller_requests_total", caller="capped", outcome="max_images_in_flight")
        >= 2
    )


def test_a_caller_over_its_rate_is_told_when_to_come_back(
    quota_server: ServerProcess, images: Images
) -> None:
    with quota_server.client(timeout=60.0) as client:
        assert post(client, METERED, images).status_code == 200  # the burst: one image
        refused = post(client, METERED, images)
    assert refused.status_code == 429
    assert error_of(refused)["limit"] == "images_per_second"
    assert 90 <= int(refused.headers["retry-after"]) <= 100  # one image at 0.01 per second


def test_a_wrong_key_is_401_and_the_single_key_still_works(
    quota_server: ServerProcess, images: Images
) -> None:
    with quota_server.client(timeout=60.0) as client:
        for key in ("wrong-key-0000000000", CAPPED[:-1], CAPPED + "0"):
            answer = post(client, key, images)
            assert answer.status_code == 401 and error_of(answer)["code"] == "unauthorized"
        assert client.post("/v1/embed", files=[("image", images.jpeg())]).status_code == 401
        assert post(client, SINGLE, images).status_code == 200
        assert client.get("/health").status_code == 200  # open, as before
        metrics = client.get("/metrics").text
    assert all(key not in metrics for key in (CAPPED, METERED, FREE, SINGLE))
    assert all(key not in quota_server.log() for key in (CAPPED, METERED, FREE, SINGLE))


def test_a_request_right_behind_a_refusal_on_the_head_keeps_its_connection(
    quota_server: ServerProcess, images: Images
) -> None:
    """The metered caller is over its rate, so the gate refuses it on the request head. Its body and the
    head of the next request arrive in one read; the next request's body then trickles in past uvicorn's
    5 s keep-alive timeout: the refusal must not leave that timer armed under it."""
    with quota_server.client(timeout=60.0) as client:
        post(client, METERED, images)  # its burst of one image spent (here or by the test above)
    image = images.jpeg(48, 48, 3)

    def request(key: str) -> bytes:
        boundary = "q0q0q0"
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.jpg"\r\n'
                "Content-Type: image/jpeg\r\n\r\n"
            ).encode()
            + image
            + f"\r\n--{boundary}--\r\n".encode()
        )
        head = (
            f"POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    refused, served = request(METERED), request(FREE)
    with socket.create_connection(("127.0.0.1", quota_server.port), timeout=30) as sock:
        sock.sendall(refused + served[:-10])
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 429 ") and b'"quota_exceeded"' in first
        time.sleep(6.0)  # past the keep-alive timeout, with the second request under way
        sock.sendall(served[-10:])
        second = sock.recv(65536)
    assert second.startswith(b"HTTP/1.1 200 "), second[:200]
