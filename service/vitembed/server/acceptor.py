"""Taking new connections as fast as they come, on uvloop.

libuv, under uvloop, takes one connection per wake-up of the listening socket (since its 1.45 release:
"don't accept() connections in a loop"). While the event loop reads request bodies, a flood's new
connections then wait in the kernel's accept queue, and every answer to them, the cheap 429 on the head
included, starts that late. Measured (bench/results/overload-history.md, "Where the storm's time goes"):
512 clients joining over one second waited a median 101–223 ms to be accepted while the loop's own lag
stayed under 20 ms. asyncio's loop takes up to the backlog per wake-up, but spends ~25 % more event-loop CPU
on every request.

``GreedyAcceptServer`` keeps uvloop and listens with a reader of its own (``Acceptor``): every waiting
connection, up to ``MAX_ACCEPTS_PER_WAKE``, per wake-up, each handed to the loop with
``connect_accepted_socket`` and uvicorn's protocol. Everywhere else (asyncio's loop, TLS, a Unix socket or
a file descriptor, sockets passed in, a host name with several addresses) it is uvicorn's own server.
Its startup follows uvicorn's own ``Server.startup`` step for step (checked against 0.55, the version the
image locks): the app's lifespan first, then the bind, so connections are refused while the app starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Callable
from typing import Any, cast

import uvicorn
from uvicorn.config import STARTUP_FAILURE

log = logging.getLogger("uvicorn.error")

MAX_ACCEPTS_PER_WAKE = 256
# the most connections taken from the kernel's queue as the server stops listening (uvicorn's backlog: 2048)
MAX_TAKEN_AT_CLOSE = 4096
# out of file descriptors or memory: accepting pauses this long instead of spinning on the error (as
# asyncio's loop does); any other accept error is the waiting connection's own, and the next one is taken
ACCEPT_RETRY_S = 0.5
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Acceptor:
    """A listening socket read by the loop: each wake-up accepts what waits. Shaped like the servers uvicorn
    keeps (``close``, ``wait_closed``, ``sockets``), so that its shutdown stops it as it stops them."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        *,
        max_per_wake: int = MAX_ACCEPTS_PER_WAKE,
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.protocol_factory = protocol_factory
        self.max_per_wake = max_per_wake
        self.wakes = 0  # reader calls, for tests and diagnostics
        self._handing: set[asyncio.Task[Any]] = set()
        self._retry: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self.sock,)

    def start(self) -> None:
        self._retry = None
        if not self._closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        self.wakes += 1
        exhausted = self._take(self.max_per_wake)
        if exhausted is not None:  # the waiting connections stay queued meanwhile (libuv would drop them)
            log.warning("accepting connections paused for %g s: %s", ACCEPT_RETRY_S, exhausted)
            self.loop.remove_reader(self.sock.fileno())
            self._retry = self.loop.call_later(ACCEPT_RETRY_S, self.start)

    def _take(self, limit: int) -> OSError | None:
        """Accept and hand over up to ``limit`` waiting connections; the error that stopped it when the
        process is out of descriptors or memory (None: the queue is empty or the limit reached)."""
        for _ in range(limit):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as exc:
                if exc.errno in OUT_OF_RESOURCES:
                    return exc
                log.debug("a connection failed while it was accepted: %s", exc)  # its own (aborted, EPROTO)
                continue
            self._start_hand_over(conn)
        return None

    def _start_hand_over(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            task = self.loop.create_task(self._hand_over(conn))
        except Exception:
            conn.close()
            raise
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)

    async def _hand_over(self, conn: socket.socket) -> None:
        """The connection to the loop as a transport with the server's protocol (uvloop sets TCP_NODELAY on
        it, as on the connections it accepts itself)."""
        try:
            _, protocol = await self.loop.connect_accepted_socket(self.protocol_factory, conn)
        except Exception as exc:  # reset before its transport existed, or the protocol failed to start
            log.log(logging.DEBUG if isinstance(exc, OSError) else logging.ERROR,
                    "an accepted connection was dropped before it was served: %r", exc)  # fmt: skip
            conn.close()
            return
        if self._closed:  # accepted just before a shutdown began: uvicorn's shutdown did not see it
            shutdown = getattr(protocol, "shutdown", None)
            if callable(shutdown):
                shutdown()

    def close(self) -> None:
        """Stop listening. The connections already in the kernel's queue are taken first and handed over
        (then shut down, which answers a request they have sent): their clients connected before the
        shutdown, and closing the listener over them would reset them with their requests unanswered."""
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        self.loop.remove_reader(self.sock.fileno())
        try:
            exhausted = self._take(MAX_TAKEN_AT_CLOSE)
            if exhausted is not None:
                log.warning("%s: connections still queued are reset as the server stops", exhausted)
        finally:
            self.sock.close()

    async def handed_over(self) -> None:
        """Until every connection being handed over is the loop's (and known to uvicorn's server state)."""
        if self._handing:
            await asyncio.gather(*list(self._handing), return_exceptions=True)

    async def wait_closed(self) -> None:
        """Nothing to wait for once ``close`` ran: no connection is accepted after it, and the connections
        being handed over then (those taken from the queue included) are shut down as they start."""
        return None


def is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is uvloop's, whose listener takes one connection per wake-up."""
    return type(loop).__module__.split(".")[0] == "uvloop"


class GreedyAcceptServer(uvicorn.Server):
    """uvicorn's server, listening through an ``Acceptor`` where it runs on uvloop over plain TCP."""

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn's wait for the connections to close, once the connections taken from the kernel's queue
        as the listener closed are known to it: otherwise a shutdown that found none yet would stop the
        app under their requests."""
        for server in self.servers:
            if isinstance(server, Acceptor):
                await server.handed_over()
        await super()._wait_tasks_to_complete()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        address = None
        if (
            sockets is None
            and is_uvloop(loop)
            and not config.is_ssl
            and config.uds is None
            and config.fd is None
        ):
            address = await _single_address(loop, config.host, config.port)
        if address is None:
            await super().startup(sockets)
            return
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(STARTUP_FAILURE)
        family, sockaddr = address
        try:  # bound only now, as uvicorn binds: connections are refused while the app starts
            sock = _listening_socket(family, sockaddr, config.backlog)
        except OSError as exc:
            log.error("error while attempting to bind on address %s: %s", sockaddr, exc.strerror or exc)
            await self.lifespan.shutdown()
            sys.exit(STARTUP_FAILURE)

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        acceptor = Acceptor(loop, sock, create_protocol)
        acceptor.start()
        self.servers = [cast(Any, acceptor)]
        self._log_started_message([sock])
        log.info("accepting every waiting connection per wake-up (the server's own accept loop on uvloop)")
        self.started = True


async def _single_address(
    loop: asyncio.AbstractEventLoop, host: str | None, port: int
) -> tuple[int, Any] | None:
    """(family, address) where ``host`` names one address to listen on; None for several (uvicorn binds
    them all) or none (uvicorn reports the error)."""
    try:
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None
    addresses = {(family, sockaddr) for family, _, _, _, sockaddr in found}
    return next(iter(addresses)) if len(addresses) == 1 else None


def _listening_socket(family: int, sockaddr: Any, backlog: int) -> socket.socket:
    """A non-blocking listening socket set up as asyncio's and uvloop's ``create_server`` set theirs."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds past TIME_WAIT
        if family == socket.AF_INET6:  # "::" is IPv6 only, as there: IPv4 needs an address of its own
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(config: uvicorn.Config) -> None:
    """``uvicorn.run`` for one process with ``GreedyAcceptServer``: status 3 (uvicorn's) when the server
    never started."""
    server = GreedyAcceptServer(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
