"""Connection limits against a real ``vitembed serve`` process on 127.0.0.1: a body trickling in gets 408
without blocking other requests, hundreds of idle connections neither block requests nor stay open past
the request-head timeout, and requests over the concurrency cap get 503 ``server_busy`` at once while the
operations routes still answer."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_server_process import HOST, ServerProcess, error_of, start_server

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

BODY_TIMEOUT_S = 3.0
HEADER_TIMEOUT_S = 3.0
MAX_REQUESTS = 3


@pytest.fixture(scope="module")
def limited(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_path,
        tmp_path_factory.mktemp("serve-limits"),
        "--body-timeout-s", str(BODY_TIMEOUT_S),
        "--header-timeout-s", str(HEADER_TIMEOUT_S),
        "--max-concurrent-requests", str(MAX_REQUESTS),
    )  # fmt: skip
    yield server
    server.stop()


def trickle_start(port: int, declared: int = 10_000) -> socket.socket:
    """A POST whose head is complete but whose body has only begun."""
    sock = socket.create_connection((HOST, port), timeout=15)
    head = (
        f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"images": [')
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(body[:length])


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (TimeoutError, ConnectionResetError):
        return False


def test_a_trickling_body_gets_408_without_blocking_other_requests(
    limited: ServerProcess, images: Images
) -> None:
    began = time.monotonic()
    slow = trickle_start(limited.port)
    with limited.client() as client:  # meanwhile, a whole request is answered at once
        started = time.monotonic()
        assert client.post("/v1/embed", files={"image": images.jpeg()}).status_code == 200
        assert time.monotonic() - started < BODY_TIMEOUT_S
    slow.sendall(b" ")  # a byte now and then does not extend the deadline
    status, headers, body = read_answer(slow)
    waited = time.monotonic() - began
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "body_timeout"
    assert body["error"]["message"] == f"the request body did not arrive within {BODY_TIMEOUT_S:g} s"
    assert BODY_TIMEOUT_S - 0.1 < waited < BODY_TIMEOUT_S + 10, waited
    assert closed_by_server(slow, 10)
    slow.close()


def test_idle_connections_do_not_block_requests_and_are_closed_after_the_head_timeout(
    limited: ServerProcess, images: Images
) -> None:
    idle = [socket.create_connection((HOST, limited.port), timeout=15) for _ in range(300)]
    partial = socket.create_connection((HOST, limited.port), timeout=15)
    partial.sendall(b"POST /v1/embed HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
    try:
        with limited.client() as client:
            started = time.monotonic()
            assert client.post("/v1/embed", files={"image": images.jpeg()}).status_code == 200
            assert client.get("/ready").status_code == 200
            assert time.monotonic() - started < HEADER_TIMEOUT_S
        status, headers, body = read_answer(partial)
        assert status == 408 and headers["connection"] == "close"
        assert body["error"]["code"] == "header_timeout"
        assert body["error"]["message"] == f"the request head did not arrive within {HEADER_TIMEOUT_S:g} s"
        assert all(closed_by_server(sock, 10) for sock in idle)
    finally:
        for sock in [*idle, partial]:
            sock.close()


def test_requests_over_the_concurrency_cap_get_503_at_once(limited: ServerProcess, images: Images) -> None:
    holders = [trickle_start(limited.port) for _ in range(MAX_REQUESTS)]
    try:
        with limited.client() as client:
            # the holders' heads are in once each connection is a request in flight
            deadline = time.monotonic() + BODY_TIMEOUT_S
            refused = None
            while time.monotonic() < deadline:
                response = client.post("/v1/embed", files={"image": images.jpeg()})
                if response.status_code == 503:
                    refused = response
                    break
            assert refused is not None, "never refused"
            assert refused.headers["retry-after"] == "1"
            assert error_of(refused) == {
                "code": "server_busy",
                "message": f"the server is handling its limit of {MAX_REQUESTS} requests; retry in 1 s",
            }
            assert client.get("/ready").status_code == 200  # operations routes are never refused
            assert client.get("/metrics").status_code == 200
        for sock in holders:  # the holders time out (408) and free their places
            assert read_answer(sock)[0] == 408
        with limited.client() as client:
            assert client.post("/v1/embed", files={"image": images.jpeg()}).status_code == 200
        assert limited.metric("vitembed_rejected_total", reason="concurrency") >= 1
    finally:
        for sock in holders:
            sock.close()
