"""``enforce_retry_after``: a connection refused on its request head is read again only once its
``Retry-After`` has passed. A real uvicorn server on 127.0.0.1 with the serving protocol
(``connection_protocol.header_timeout_protocol``) and a gate that refuses requests marked ``x-refuse``; the
clients are raw sockets, so the timings are the server's. Lower bounds are the timer's (robust); upper
bounds are generous for a VM whose speed drifts."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from threaded_server import running_on_a_thread
from vitembed.metrics import Metrics
from vitembed.server.connection_protocol import (
    ANSWER_WAIT_S,
    header_timeout_protocol,
    peer_closed,
    retry_after_of,
)
from vitembed.server.errors import RequestContextMiddleware

HOST = "127.0.0.1"
RETRY_AFTER_S = 2
PROMPT_S = 1.0  # "at once", with room for a busy machine
BODY = b"x" * 50_000  # a body the refused request still sends (read and dropped)
REFUSAL = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
    b"retry-after: " + str(RETRY_AFTER_S).encode() + b"\r\n\r\n{}"
)


MARK_KEY = "test.mark"  # what the gate hands to a request it lets through, as the real gate hands its lease
DONE: list[str] = []  # marks of the requests the protocol reported done (gate_done)
GATED: list[str] = []  # marks of the requests whose head reached the gate


def gate(path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]]) -> bytes | dict[str, object] | None:
    fields = dict(headers)
    if fields.get(b"x-refuse") == b"1":
        return REFUSAL
    if b"x-mark" in fields:
        GATED.append(fields[b"x-mark"].decode())
        return {MARK_KEY: fields[b"x-mark"].decode()}
    return None


def gate_done(scope: dict[str, object]) -> None:
    DONE.append(str(scope[MARK_KEY]))


async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    """200 with the body's size; 429 with Retry-After after reading the body when marked ``x-app-refuse``
    (the app's own admission refusal, which the request head could not predict)."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    refuse = (b"x-app-refuse", b"1") in scope["headers"]
    reply: dict[str, object] = {"received": size}
    if (b"x-echo-mark", b"1") in scope["headers"]:
        reply["mark"] = scope.get(MARK_KEY)  # what the request sees of the gate's entries
    body = json.dumps(reply).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if refuse:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": 429 if refuse else 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


app = RequestContextMiddleware(endpoint, metrics=Metrics())  # notes a 429's Retry-After for the protocol


def serve(enforce: bool, keep_alive_s: int = 5) -> Iterator[int]:
    protocol = header_timeout_protocol(10.0, gate=gate, enforce_retry_after=enforce, gate_done=gate_done)
    assert protocol is not None, "httptools is a dependency of the service extra"
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = int(probe.getsockname()[1])
    config = uvicorn.Config(
        app,
        host=HOST,
        port=port,
        http=protocol,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=keep_alive_s,
    )
    with running_on_a_thread(uvicorn.Server(config)):
        yield port


@pytest.fixture(scope="module")
def enforcing() -> Iterator[int]:
    yield from serve(enforce=True)


@pytest.fixture(scope="module")
def lenient() -> Iterator[int]:
    yield from serve(enforce=False)


KEEP_ALIVE_S = 1  # shorter than RETRY_AFTER_S, as uvicorn's 5 s is shorter than a spread Retry-After


@pytest.fixture(scope="module", params=[True, False], ids=["enforcing", "lenient"])
def short_keep_alive(request: pytest.FixtureRequest) -> Iterator[int]:
    yield from serve(enforce=request.param, keep_alive_s=KEEP_ALIVE_S)


def send(sock: socket.socket, refuse: bool, *, by_app: bool = False) -> None:
    head = (
        f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(BODY)}\r\n"
        f"x-refuse: {int(refuse and not by_app)}\r\nx-app-refuse: {int(refuse and by_app)}\r\n\r\n"
    )
    sock.sendall(head.encode() + BODY)


def answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1]), head + b"\r\n\r\n" + body


def timed(sock: socket.socket, refuse: bool, *, by_app: bool = False) -> tuple[int, float]:
    began = time.monotonic()
    send(sock, refuse, by_app=by_app)
    status, _ = answer(sock)
    return status, time.monotonic() - began


def connect(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=30)


def test_retry_after_is_read_from_the_raw_answer() -> None:
    assert retry_after_of(REFUSAL) == RETRY_AFTER_S
    assert retry_after_of(b"HTTP/1.1 429 X\r\nRetry-After: 7\r\n\r\n{}") == 7
    assert retry_after_of(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n") == 0
    assert retry_after_of(b"HTTP/1.1 429 X\r\nretry-after: soon\r\n\r\n") == 0


def test_a_request_sent_before_retry_after_waits_for_it_and_is_then_served(enforcing: int) -> None:
    with connect(enforcing) as early, connect(enforcing) as other, connect(enforcing) as third:
        status, seconds = timed(early, refuse=True)
        assert (status, seconds < PROMPT_S) == (429, True)
        began = time.monotonic()
        send(early, refuse=False)  # at once, ignoring Retry-After
        # meanwhile another connection is judged at once, refusals included
        assert timed(other, refuse=True)[0] == 429 and time.monotonic() - began < PROMPT_S
        assert timed(third, refuse=False)[0] == 200 and time.monotonic() - began < PROMPT_S
        status, body = answer(early)
        waited = time.monotonic() - began
        assert status == 200 and json.loads(body.partition(b"\r\n\r\n")[2]) == {"received": len(BODY)}
        assert RETRY_AFTER_S - 0.1 <= waited < RETRY_AFTER_S + PROMPT_S, waited


def test_a_client_that_honours_retry_after_is_not_held(enforcing: int) -> None:
    with connect(enforcing) as polite:
        assert timed(polite, refuse=True)[0] == 429
        time.sleep(RETRY_AFTER_S + 0.1)
        status, seconds = timed(polite, refuse=False)
        assert status == 200 and seconds < PROMPT_S


def test_an_early_request_refused_again_restarts_the_wait(enforcing: int) -> None:
    with connect(enforcing) as early:
        assert timed(early, refuse=True)[0] == 429
        status, seconds = timed(early, refuse=True)  # held, then refused again: a new Retry-After
        assert status == 429 and RETRY_AFTER_S - 0.1 <= seconds < RETRY_AFTER_S + PROMPT_S
        status, seconds = timed(early, refuse=False)
        assert status == 200 and RETRY_AFTER_S - 0.1 <= seconds < RETRY_AFTER_S + PROMPT_S


def test_without_enforcement_an_early_request_is_judged_at_once(lenient: int) -> None:
    with connect(lenient) as early:
        assert timed(early, refuse=True)[0] == 429
        status, seconds = timed(early, refuse=False)
        assert status == 200 and seconds < PROMPT_S


def test_a_429_from_the_app_is_enforced_too(enforcing: int) -> None:
    with connect(enforcing) as early:
        status, seconds = timed(early, refuse=True, by_app=True)
        assert status == 429 and seconds < PROMPT_S
        status, seconds = timed(early, refuse=False)
        assert status == 200 and RETRY_AFTER_S - 0.1 <= seconds < RETRY_AFTER_S + PROMPT_S


REFUSED_HEAD = (
    f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(BODY)}\r\nx-refuse: 1\r\n\r\n"
)


def test_a_refusal_on_the_head_is_sent_before_its_body(enforcing: int) -> None:
    with connect(enforcing) as sock:
        began = time.monotonic()
        sock.sendall(REFUSED_HEAD.encode())
        status, _ = answer(sock)
        assert status == 429 and time.monotonic() - began < PROMPT_S


def test_a_request_in_the_same_read_as_the_refused_body_is_held(enforcing: int) -> None:
    """A client that sends again at once, right after the 429 that came before its body was all sent: the
    rest of the refused body and the next request arrive in one read, which is split where the body ends."""
    with connect(enforcing) as sock:
        sock.sendall(REFUSED_HEAD.encode() + BODY[:1000])
        assert answer(sock)[0] == 429
        began = time.monotonic()
        following = (
            f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(BODY)}\r\n"
            "x-refuse: 0\r\nx-app-refuse: 0\r\n\r\n"
        )
        sock.sendall(BODY[1000:] + following.encode() + BODY)
        status, body = answer(sock)
        waited = time.monotonic() - began
        assert status == 200 and json.loads(body.partition(b"\r\n\r\n")[2]) == {"received": len(BODY)}
        assert RETRY_AFTER_S - 0.1 <= waited < RETRY_AFTER_S + PROMPT_S, waited


CHUNKED_HEAD = f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\nx-refuse: 1\r\n\r\n"


def test_a_refused_chunked_body_is_answered_once_it_is_in(enforcing: int) -> None:
    """A chunked body has no length to split the read at: its 429 waits for the body's end."""
    with connect(enforcing) as sock:
        sock.sendall(CHUNKED_HEAD.encode() + b"5\r\nhello\r\n")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(30)
        began = time.monotonic()
        sock.sendall(b"0\r\n\r\n")
        status, _ = answer(sock)
        assert status == 429 and time.monotonic() - began < PROMPT_S


def test_a_refused_chunked_body_that_trickles_is_answered_after_a_second(enforcing: int) -> None:
    with connect(enforcing) as sock:
        began = time.monotonic()
        sock.sendall(CHUNKED_HEAD.encode() + b"5\r\nhello\r\n")  # the rest never comes
        status, _ = answer(sock)
        assert status == 429 and ANSWER_WAIT_S - 0.1 <= time.monotonic() - began < ANSWER_WAIT_S + PROMPT_S


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(PROMPT_S)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    finally:
        sock.settimeout(30)


def test_a_refused_connection_stays_open_until_its_retry_after_has_passed(short_keep_alive: int) -> None:
    """The keep-alive timeout counts from the end of the Retry-After a connection was given: a caller that
    waits as told (here 2 s, past the 1 s keep-alive) sends on the same connection; others close as usual."""
    with (
        connect(short_keep_alive) as served,
        connect(short_keep_alive) as refused,
        connect(short_keep_alive) as refused_by_app,
        connect(short_keep_alive) as gone,
    ):
        assert timed(served, refuse=False)[0] == 200
        assert timed(refused, refuse=True)[0] == 429
        assert timed(refused_by_app, refuse=True, by_app=True)[0] == 429
        assert timed(gone, refuse=True)[0] == 429
        time.sleep(RETRY_AFTER_S + 0.1)
        assert closed_by_server(served)  # 1 s keep-alive after its 200
        for sock in (refused, refused_by_app):
            status, seconds = timed(sock, refuse=False)  # still open: answered at once
            assert status == 200 and seconds < PROMPT_S
        time.sleep(KEEP_ALIVE_S + PROMPT_S)  # after a 200: the usual timeout again
        assert closed_by_server(refused) and closed_by_server(refused_by_app)
        assert closed_by_server(gone)  # never came back: closed once Retry-After + keep-alive had passed


def test_a_request_right_behind_a_refusal_outlives_the_stretched_keep_alive(short_keep_alive: int) -> None:
    """The refused body and the next request's head arrive in one read, and that request's body trickles
    in past Retry-After + keep-alive (3 s): the timer the refusal armed must be off while it is read."""
    head = f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(BODY)}\r\nx-refuse: 0\r\n\r\n"
    with connect(short_keep_alive) as sock:
        sock.sendall(REFUSED_HEAD.encode() + BODY + head.encode() + BODY[:-10])
        assert answer(sock)[0] == 429
        time.sleep(RETRY_AFTER_S + KEEP_ALIVE_S + 0.5)
        sock.sendall(BODY[-10:])
        status, body = answer(sock)
        assert status == 200 and json.loads(body.partition(b"\r\n\r\n")[2]) == {"received": len(BODY)}


def marked(sock: socket.socket, mark: str | None) -> object:
    """A request that asks for the gate's mark as its scope holds it; ``mark`` None: the gate gives none."""
    head = f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 2\r\nx-echo-mark: 1\r\n"
    sock.sendall((head + (f"x-mark: {mark}\r\n" if mark else "") + "\r\n{}").encode())
    status, raw = answer(sock)
    assert status == 200
    return json.loads(raw.partition(b"\r\n\r\n")[2])["mark"]


def until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_what_the_gate_hands_a_request_reaches_it_and_no_other_and_comes_back_when_it_ends(
    enforcing: int,
) -> None:
    """The gate's entries go into that request's scope (the real gate's lease travels so), not into the
    next request on the connection nor another connection's; the protocol hands them back once the answer
    is sent, or when the connection is lost before it (the real gate then frees a place never traded)."""
    DONE.clear()
    with connect(enforcing) as first, connect(enforcing) as second:
        assert marked(first, "a") == "a"
        assert marked(second, None) is None
        assert marked(first, None) is None
        assert marked(second, "b") == "b"
        assert marked(first, "c") == "c"
        assert until(lambda: sorted(DONE) == ["a", "b", "c"])
    with connect(enforcing) as lost:  # the head, then the connection goes before the body
        lost.sendall(
            f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 10\r\nx-mark: d\r\n\r\n".encode()
        )
        time.sleep(0.2)
    assert until(lambda: sorted(DONE) == ["a", "b", "c", "d"])


@pytest.mark.parametrize("how", ["fin", "reset"])
def test_a_held_request_whose_client_left_is_dropped_unread(enforcing: int, how: str) -> None:
    """When a flood stops, its callers go and leave their early requests held: once the hold ends the
    server finds the client gone and drops the connection, so the request never reaches the gate (nor an
    admission place, a decode or a forward pass). A client still there is served as before."""
    GATED.clear()
    with connect(enforcing) as stays, connect(enforcing) as leaves:
        for sock in (stays, leaves):
            assert timed(sock, refuse=True)[0] == 429
        released = time.monotonic() + RETRY_AFTER_S  # no later than this, the leaving one's hold ends
        for sock, mark in ((stays, "stays"), (leaves, "leaves")):  # early: both held
            head = f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(BODY)}\r\n"
            sock.sendall(head.encode() + f"x-mark: {mark}\r\n\r\n".encode() + BODY)
        if how == "reset":
            leaves.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        leaves.close()
        status, raw = answer(stays)
        assert status == 200 and json.loads(raw.partition(b"\r\n\r\n")[2]) == {"received": len(BODY)}
    time.sleep(max(0.0, released - time.monotonic()) + PROMPT_S)  # its release has run (or would have)
    assert GATED == ["stays"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_peer_closed_sees_a_fin_or_reset_behind_unread_bytes_on_either_loop(loop: str) -> None:
    """What the hold's release asks of a paused connection, on both event loops uvicorn may run: the peer
    is there while its bytes wait unread, and gone once it closes, however many bytes are still unread."""

    async def probe(how: str) -> tuple[bool, bool]:
        accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

        async def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.pause_reading()  # type: ignore[attr-defined]
            accepted.set_result(writer)

        server = await asyncio.start_server(on_connect, HOST, 0)
        client = socket.create_connection(server.sockets[0].getsockname()[:2])
        client.sendall(BODY)  # unread by the server
        writer = await accepted
        await asyncio.sleep(0.1)
        before = peer_closed(writer.transport)
        if how == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()
        await asyncio.sleep(0.1)
        after = peer_closed(writer.transport)
        writer.close()
        server.close()
        return before, after

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        results = [uvloop.run(probe(how)) for how in ("fin", "reset")]
    else:
        results = [asyncio.run(probe(how)) for how in ("fin", "reset")]
    assert results == [(False, True), (False, True)]
