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
