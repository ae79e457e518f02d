"""A graceful shutdown answers every request a client had begun to send (``connection_protocol``,
``shutdown``): uvicorn closes at once a connection with no request in progress, so a request whose head was
half parsed, or whose bytes the event loop had not read yet, was cut off with no answer (a client that
connected and sent before the listener closed then saw the connection reset). Such a request is answered
with ``connection: close`` and the connection closed after it. A connection that has not sent its first
request gets ``FIRST_REQUEST_GRACE_S`` to send it; one that has served requests and sent nothing more, or
whose unread bytes are no request, is closed at once. With a gate refusing on the request head: a request
held for its connection's ``Retry-After`` is judged at once, and a refusal says ``connection: close``. The
server is uvicorn with the server's protocol and accept loop, on a thread, on uvloop."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from threaded_server import hello, running_on_a_thread
from vitembed.server.acceptor import Acceptor, GreedyAcceptServer
from vitembed.server.connection_protocol import FIRST_REQUEST_GRACE_S, header_timeout_protocol

pytest.importorskip("uvloop")
pytest.importorskip("httptools")

REQUEST_HEAD = b"GET / HTTP/1.1\r\nHost: test\r\n"


def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


HOLD_S = 6  # the Retry-After of the test gate's refusals: far longer than any answer during the drain
REFUSAL = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
    b"retry-after: " + str(HOLD_S).encode() + b"\r\n\r\n{}"
)


def refusing_gate(path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """Refuses on the head the requests marked ``x-refuse: 1``, as the admission gate refuses."""
    return REFUSAL if (b"x-refuse", b"1") in headers else None


@contextmanager
def serving(gate: Any = None) -> Iterator[tuple[GreedyAcceptServer, int]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    protocol = header_timeout_protocol(10.0, gate=gate, enforce_retry_after=True)
    if protocol is None:
        pytest.fail("httptools is a dependency of the server")
    config = uvicorn.Config(
        hello, host="127.0.0.1", port=port, loop="uvloop", http=protocol, log_level="warning"
    )
    with running_on_a_thread(GreedyAcceptServer(config), timeout_s=10) as server:
        yield server, port


def only_connection(server: GreedyAcceptServer) -> Any:
    until(lambda: len(server.server_state.connections) == 1)
    return next(iter(server.server_state.connections))


def shut_down(server: GreedyAcceptServer, connection: Any) -> None:
    """Begin the graceful shutdown and wait until the server has closed its listener and asked
    ``connection`` to shut down (uvicorn does both in one step)."""
    server.should_exit = True
    until(lambda: isinstance(server.servers[0], Acceptor) and server.servers[0]._closed)
    until(lambda: connection._draining or connection.transport.is_closing())


def one_request(sock: socket.socket) -> bytes:
    """A keep-alive request and its whole answer (the app's body is 2 bytes)."""
    sock.sendall(REQUEST_HEAD + b"\r\n")
    answer = b""
    while not answer.endswith(b"\r\n\r\nok"):
        answer += sock.recv(65536)
    return answer


def unread_until_the_shutdown(connection: Any) -> None:
    """What the client sends next stays in the kernel's buffer until the shutdown, as when both reach the
    loop in the same pass."""
    connection.loop.call_soon_threadsafe(connection.flow.pause_reading)
    until(lambda: connection.flow.read_paused)


def answer_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_request_head_begun_before_the_shutdown_is_answered_then_the_connection_closes() -> None:
    with serving() as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(REQUEST_HEAD)  # the head, all but its last line
        connection = only_connection(server)
        until(lambda: connection._head_begun)
        shut_down(server, connection)
        sock.sendall(b"\r\n")
        answer = answer_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert answer.endswith(b"\r\n\r\nok")


def test_a_request_the_loop_had_not_read_at_the_shutdown_is_answered() -> None:
    with serving() as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        connection = only_connection(server)
        unread_until_the_shutdown(connection)
        sock.sendall(REQUEST_HEAD + b"\r\n")
        time.sleep(0.1)  # in the kernel's buffer, unread
        shut_down(server, connection)
        answer = answer_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close\r\n" in answer.lower()


def test_a_first_request_sent_just_after_the_shutdown_began_is_answered() -> None:
    with serving() as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        connection = only_connection(server)
        shut_down(server, connection)  # connected before the listener closed, not sent yet
        sock.sendall(REQUEST_HEAD + b"\r\n")
        answer = answer_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close\r\n" in answer.lower()


def test_a_new_connection_that_sends_nothing_is_closed_after_its_grace() -> None:
    with serving() as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        connection = only_connection(server)
        began = time.monotonic()
        shut_down(server, connection)
        assert answer_until_closed(sock) == b""
        assert FIRST_REQUEST_GRACE_S - 0.2 < time.monotonic() - began < FIRST_REQUEST_GRACE_S + 2.0


def test_a_connection_that_served_requests_and_sent_nothing_more_is_closed_at_once() -> None:
    with serving() as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        assert one_request(sock).startswith(b"HTTP/1.1 200 OK\r\n")
        connection = only_connection(server)
        began = time.monotonic()
        shut_down(server, connection)
        assert answer_until_closed(sock) == b""
        assert time.monotonic() - began < FIRST_REQUEST_GRACE_S


def test_unread_bytes_that_are_no_request_do_not_hold_the_shutdown() -> None:
    with serving() as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        assert one_request(sock).startswith(b"HTTP/1.1 200 OK\r\n")
        connection = only_connection(server)
        unread_until_the_shutdown(connection)
        sock.sendall(b"\r\n")  # an empty line between requests: read, and no request begins
        time.sleep(0.1)
        began = time.monotonic()
        shut_down(server, connection)
        assert answer_until_closed(sock) == b""
        assert time.monotonic() - began < FIRST_REQUEST_GRACE_S


def marked(refuse: bool) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\nx-refuse: %d\r\n\r\nhi" % refuse


def test_an_early_request_held_at_the_shutdown_is_answered_at_once_not_after_its_retry_after() -> None:
    with serving(refusing_gate) as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(marked(refuse=True))
        refused = b""
        while not refused.endswith(b"{}"):
            refused += sock.recv(65536)
        assert refused.startswith(b"HTTP/1.1 429 ")
        connection = only_connection(server)
        sock.sendall(marked(refuse=False))  # before the Retry-After: held by the server
        until(lambda: connection._held is not None)
        began = time.monotonic()
        shut_down(server, connection)
        answer = answer_until_closed(sock)
        waited = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert waited < HOLD_S / 2


def test_a_refusal_on_the_head_during_the_drain_says_connection_close() -> None:
    with serving(refusing_gate) as (server, port), socket.create_connection(("127.0.0.1", port)) as sock:
        connection = only_connection(server)
        shut_down(server, connection)  # a new connection: its first request may still come
        sock.sendall(marked(refuse=True))
        answer = answer_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 429 ")
    assert b"\r\nconnection: close\r\n" in answer.lower()
    assert answer.endswith(b"\r\n\r\n{}")
