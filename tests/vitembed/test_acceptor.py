"""The server's own accept loop (``vitembed.server.acceptor``): one wake-up of the listening socket takes
every connection waiting in the kernel's queue (libuv takes one), each accepted connection is a working
transport with TCP_NODELAY, running out of file descriptors pauses accepting and then resumes it while a
connection's own accept error does not, connections accepted as a shutdown begins are shut down, and so are
those still in the kernel's queue when it stops listening (taken, not reset), and uvicorn's server listens
through it on uvloop (its own listener elsewhere), failing with uvicorn's status 3 when the port is taken."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from threaded_server import hello, running_on_a_thread
from vitembed.server import acceptor as acceptor_module
from vitembed.server.acceptor import Acceptor, GreedyAcceptServer, _listening_socket, run_server

uvloop = pytest.importorskip("uvloop")


class Recorder(asyncio.Protocol):
    made: list[Recorder]

    def __init__(self, made: list[Recorder]) -> None:
        self.made = made
        self.received = b""
        self.transport: asyncio.Transport | None = None
        self.shut_down = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.made.append(self)

    def data_received(self, data: bytes) -> None:
        self.received += data

    def shutdown(self) -> None:  # as uvicorn's protocols have
        self.shut_down = True


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


def test_one_wake_up_takes_every_waiting_connection_each_a_working_transport() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = _listening_socket(socket.AF_INET, ("127.0.0.1", 0), 128)
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]  # all in the queue
        made: list[Recorder] = []
        acceptor = Acceptor(loop, listener, lambda: Recorder(made))
        acceptor.start()
        await until(lambda: len(made) == 64)
        assert acceptor.wakes == 1  # libuv's own listener would have taken one per wake-up
        for index, client in enumerate(clients):
            client.sendall(b"client %d" % index)
        await until(lambda: all(p.received for p in made))
        assert sorted(p.received for p in made) == sorted(b"client %d" % i for i in range(64))
        sock = made[0].transport.get_extra_info("socket")  # type: ignore[union-attr]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        acceptor.close()
        for client in clients:
            client.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)

    uvloop.run(main())


class FailsOnce:
    """A listening socket whose first accept fails with ``error`` (EMFILE: the process is out of file
    descriptors)."""

    def __init__(self, sock: socket.socket, error: int = 24) -> None:
        self.sock = sock
        self.error = error
        self.failed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> tuple[socket.socket, Any]:
        if not self.failed:
            self.failed = True
            raise OSError(self.error, os.strerror(self.error))
        return self.sock.accept()

    def close(self) -> None:
        self.sock.close()


def test_an_accept_error_pauses_accepting_then_it_resumes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(acceptor_module, "ACCEPT_RETRY_S", 0.2)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = _listening_socket(socket.AF_INET, ("127.0.0.1", 0), 128)
        client = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
        made: list[Recorder] = []
        acceptor = Acceptor(loop, FailsOnce(listener), lambda: Recorder(made))  # type: ignore[arg-type]
        began = time.monotonic()
        acceptor.start()
        await until(lambda: len(made) == 1)
        assert time.monotonic() - began >= 0.2  # paused, not spinning on the error
        assert acceptor.wakes == 2
        acceptor.close()
        client.close()

    logger = logging.getLogger("uvicorn.error")  # uvicorn's logging config stops it propagating to root
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            uvloop.run(main())
    finally:
        logger.removeHandler(caplog.handler)
    assert "accepting connections paused for 0.2 s: [Errno 24] Too many open files" in caplog.text


def test_a_connections_own_accept_error_takes_the_next_one_at_once() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = _listening_socket(socket.AF_INET, ("127.0.0.1", 0), 128)
        client = socket.create_connection(("127.0.0.1", listener.getsockname()[1]))
        made: list[Recorder] = []
        failing = FailsOnce(listener, errno.EPROTO)
        acceptor = Acceptor(loop, failing, lambda: Recorder(made))  # type: ignore[arg-type]
        acceptor.start()
        await until(lambda: len(made) == 1)
        assert failing.failed and acceptor.wakes == 1  # not paused: the same wake-up took the connection
        acceptor.close()
        client.close()

    uvloop.run(main())


def test_connections_accepted_as_a_shutdown_begins_are_shut_down() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = _listening_socket(socket.AF_INET, ("127.0.0.1", 0), 128)
        clients = [socket.create_connection(("127.0.0.1", listener.getsockname()[1])) for _ in range(8)]
        made: list[Recorder] = []
        acceptor = Acceptor(loop, listener, lambda: Recorder(made))
        acceptor._accept()  # accepted, their hand-over not yet run
        acceptor.close()  # uvicorn's shutdown closes the listener, then shuts down the connections it knows
        await until(lambda: len(made) == 8)
        assert all(p.shut_down for p in made)
        for client in clients:
            client.close()

    uvloop.run(main())


def test_connections_still_in_the_kernels_queue_when_it_stops_are_taken_and_shut_down() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = _listening_socket(socket.AF_INET, ("127.0.0.1", 0), 128)
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]  # queued, not accepted
        for index, client in enumerate(clients):
            client.sendall(b"request %d" % index)
        made: list[Recorder] = []
        acceptor = Acceptor(loop, listener, lambda: Recorder(made))
        acceptor.start()
        acceptor.close()  # before the loop ran its reader: closing the listener over them would reset them
        await acceptor.handed_over()  # what the server's shutdown awaits before it waits for connections
        assert len(made) == 8
        await until(lambda: all(p.received for p in made))
        assert acceptor.wakes == 0
        assert all(p.shut_down for p in made)  # each then answers what it was sent (test_drain.py)
        assert sorted(p.received for p in made) == sorted(b"request %d" % i for i in range(8))
        for client in clients:
            client.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)

    uvloop.run(main())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(loop: str, port: int) -> Iterator[GreedyAcceptServer]:
    config = uvicorn.Config(hello, host="127.0.0.1", port=port, loop=loop, log_level="warning")
    with running_on_a_thread(GreedyAcceptServer(config), timeout_s=10) as server:
        yield server


@pytest.mark.parametrize(("loop", "own_acceptor"), [("uvloop", True), ("asyncio", False)])
def test_uvicorn_listens_through_the_acceptor_on_uvloop_and_its_own_listener_elsewhere(
    loop: str, own_acceptor: bool
) -> None:
    port = free_port()
    with serving(loop, port) as server:
        assert isinstance(server.servers[0], Acceptor) is own_acceptor
        with httpx.Client() as client:
            answers = [client.get(f"http://127.0.0.1:{port}/").text for _ in range(3)]
        assert answers == ["ok"] * 3
    with pytest.raises(OSError):  # stopped: nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_a_taken_port_ends_the_run_with_uvicorns_startup_failure_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    binds: list[Any] = []

    def listening_socket(family: int, sockaddr: Any, backlog: int) -> socket.socket:
        binds.append(sockaddr)
        return _listening_socket(family, sockaddr, backlog)

    monkeypatch.setattr(acceptor_module, "_listening_socket", listening_socket)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = uvicorn.Config(hello, host="127.0.0.1", port=port, loop="uvloop")
        with pytest.raises(SystemExit) as stopped:
            run_server(config)
    assert stopped.value.code == 3
    assert binds == [("127.0.0.1", port)]  # the accept loop's own bind failed, not uvicorn's
