"""uvicorn's httptools protocol with the server's connection-level rules (``header_timeout_protocol``).

- A deadline for the request head: a connection that sends no complete request head within
  ``header_timeout_s`` of opening (or of starting a request) is closed (408 if it had begun one). Idle
  keep-alive connections are closed by uvicorn's own keep-alive timeout, counted on a connection answered
  429 from the end of the ``Retry-After`` it was given (a caller that waits as told finds its connection
  open); a request held until that Retry-After is dropped with its connection if its client left meanwhile.
- With a gate (``early_refusal.AdmissionGate``), admission refusals answered on the request head, before
  any ASGI task exists.
- A graceful shutdown that answers the request a connection has begun to send (``shutdown``), instead of
  uvicorn's closing every connection with no request in progress at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import select
import struct
import termios
from collections.abc import Callable, Sequence
from typing import Any, cast

from vitembed.server.errors import RETRY_AFTER_SCOPE_KEY, retry_after_seconds, sanitise_request_id

log = logging.getLogger("vitembed.service")


# (path, query, headers) -> a refusal to send, or None / entries for the request's scope to let it through
Gate = Callable[[str, bytes, Sequence[tuple[bytes, bytes]]], bytes | dict[str, Any] | None]


MAX_HOLD_S = 10.0  # the longest a request sent before its connection's Retry-After is held
# the longest a refusal on the head of a chunked request waits for its body before it is sent
ANSWER_WAIT_S = 1.0
# at a graceful shutdown, how long a connection that has not sent a request yet may still send its first
# (its client connected before the listener closed and is about to send)
FIRST_REQUEST_GRACE_S = 1.0


def peer_closed(transport: asyncio.BaseTransport) -> bool:
    """Whether the peer has closed its side of a connection whose reading is paused (a held request): Linux
    reports the FIN or RST with POLLRDHUP even while unread bytes wait in front of it. A client that only
    half-closes after its request counts as gone, as uvicorn treats it (its end of input closes the
    connection). False where the platform has no such flag or the socket cannot be asked: the request is
    then read, and its disconnect found as for any other."""
    flag = getattr(select, "POLLRDHUP", None)
    sock = transport.get_extra_info("socket")
    if flag is None or sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), flag)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for a connection that the loop has not read yet (0 where the socket cannot be
    asked)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except (OSError, ValueError):
        return 0


def retry_after_of(response: bytes) -> float:
    """The seconds a raw HTTP answer's ``retry-after`` header names (0 without one)."""
    head = response.partition(b"\r\n\r\n")[0].lower()
    start = head.find(b"\r\nretry-after:")
    if start < 0:
        return 0.0
    return retry_after_seconds(head[start + len(b"\r\nretry-after:") :].partition(b"\r\n")[0])


def header_timeout_protocol(
    header_timeout_s: float,
    gate: Gate | None = None,
    *,
    enforce_retry_after: bool = False,
    gate_done: Callable[[dict[str, Any]], None] | None = None,
) -> type[Any] | None:
    """uvicorn's httptools protocol with a deadline on the request head and, with ``gate``, refusals
    answered on the request head (``early_refusal.AdmissionGate``); None without httptools.

    With ``enforce_retry_after``, a connection whose request was refused on its head is not read again
    until the ``Retry-After`` it was given has passed: a client that ignores it and sends again at once
    waits for that time (then its request is judged as usual), instead of spending a refusal's CPU per
    round trip. Clients that honour ``Retry-After`` never notice; other connections are not affected. A
    refusal on the head is sent at once; a client that retries at once can then start its next request in
    the same read as the rest of the refused body, so reads are split where that body ends (its
    ``Content-Length``) and what follows is held like any early request. A chunked body has no length to
    split at: its refusal is sent once the body is in (at most ``ANSWER_WAIT_S`` later).

    A gate that lets a request through may return entries for its scope (the place it holds for it);
    ``gate_done`` is then called with that scope once the request's answer is sent or its connection is
    lost (a pipelined request is not gated)."""
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # h11 only: uvicorn's own keep-alive timeout still closes idle connections
        log.warning("httptools is not installed: no request-head timeout (pip install httptools)")
        return None

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _head_begun = False
        _discarding = False  # a request answered on its head: its body is read and dropped
        _close_after = False
        _retry_at: float | None = None  # loop time before which a new request on this connection is early
        _held: list[bytes] | None = None  # an early request's bytes, read once its Retry-After has passed
        _release_timer: asyncio.TimerHandle | None = None
        _pending_answer: bytes | None = None  # a head refusal waiting for its body to be read
        _answer_timer: asyncio.TimerHandle | None = None
        _body_left: int | None = None  # bytes of a refused request's body still to come (Content-Length)
        _told_until: float = 0.0  # loop time the last Retry-After on this connection named
        _gated_scope: dict[str, Any] | None = None  # the request the gate let through with scope entries
        _draining = False  # the server shuts down: the request begun here is answered, then it closes
        _drain_timer: asyncio.TimerHandle | None = None
        _requests_begun = 0

        def _gated_request_done(self) -> None:
            scope, self._gated_scope = self._gated_scope, None
            if scope is not None and gate_done is not None:
                gate_done(scope)

        def _note_retry_after(self, seconds: float) -> None:
            self._told_until = self.loop.time() + min(MAX_HOLD_S, seconds)

        def _arm_keep_alive(self) -> None:
            """uvicorn's keep-alive timeout, counted from the end of the last Retry-After given here: with
            the spread, a refused caller may be told to wait ~9 s, longer than the 5 s default, and a caller
            that waits as told should not pay for a new connection (or find it closed mid-send)."""
            self._unset_keepalive_if_required()
            if self.transport.is_closing():
                return
            wait = self.timeout_keep_alive + max(0.0, self._told_until - self.loop.time())
            self.timeout_keep_alive_task = self.loop.call_later(wait, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            left = self._body_left
            if self._discarding and left is not None and len(data) > left:
                # the refused request's body ends inside this read: what follows is another request
                super().data_received(data[:left])
                self.data_received(data[left:])
                return
            if self._held is not None:
                self._held.append(data)
                return
            if self._retry_at is not None and not self._discarding:
                early = self._retry_at - self.loop.time()
                if early > 0 and self._idle():  # a new request before its Retry-After
                    self._held = [data]
                    self.flow.pause_reading()
                    self._unset_keepalive_if_required()
                    self._release_timer = self.loop.call_later(early, self._release_held)
                    return
                self._retry_at = None
            super().data_received(data)
            if self._draining:
                self._close_if_drained()

        def _release_held(self) -> None:
            self._release_timer = None
            held, self._held = self._held or [], None
            self._retry_at = None
            if self.transport.is_closing():
                return
            if peer_closed(self.transport):  # the client left during the hold (a flood that stopped): its
                # request would only be admitted, read and decoded for nobody, and take a new caller's place
                self.transport.close()
                return
            self.flow.resume_reading()
            for chunk in held:  # a chunk that starts another early request is held again
                self.data_received(chunk)

        def shutdown(self) -> None:
            """The server's graceful shutdown. uvicorn closes a connection with no request in progress at
            once. Here one whose next request has begun to arrive (a head partly parsed, an early request
            held, a refused body still coming, or bytes the loop has not read yet) has it answered, with
            ``connection: close``, and closes after; so does one that has not sent its first request yet,
            if that request comes within ``FIRST_REQUEST_GRACE_S`` (its client connected before the listener
            closed). A request that does not complete within ``header_timeout_s`` is not waited for."""
            if not self._idle() or self.transport.is_closing():
                super().shutdown()
                return
            begun = self._begun()
            fresh = self._requests_begun == 0
            if not (begun or fresh or unread_bytes(self.transport) > 0):
                super().shutdown()
                return
            self._draining = True
            self._retry_at = None  # no Retry-After to wait out any more: a request is judged when it comes
            self._unset_keepalive_if_required()
            wait = header_timeout_s if begun or not fresh else FIRST_REQUEST_GRACE_S
            self._drain_timer = self.loop.call_later(wait, self._drain_timed_out)
            try:
                if self._held is not None:
                    if self._release_timer is not None:
                        self._release_timer.cancel()
                    self._release_held()
                else:
                    self.flow.resume_reading()
                    self._close_if_drained()
            except Exception:  # uvicorn's shutdown goes on with the other connections
                log.exception("a connection failed while the server drained it")
                self.transport.close()

        def _close_if_drained(self) -> None:
            """While draining: close once nothing is begun or in progress here (what was read was not a
            request, or its answer is out)."""
            if not self._draining or self.transport.is_closing():
                return
            waiting = self._pending_answer is not None or unread_bytes(self.transport) > 0
            if self._idle() and not self._begun() and not waiting and self._requests_begun > 0:
                self.transport.close()

        def _idle(self) -> bool:
            """No request being answered here."""
            return self.cycle is None or self.cycle.response_complete

        def _begun(self) -> bool:
            """A next request on its way in: its head partly parsed, held for its Retry-After, or a refused
            body still coming."""
            return self._head_begun or self._held is not None or self._discarding

        def _drain_timed_out(self) -> None:
            self._drain_timer = None
            if self.transport.is_closing() or not self._idle():
                return  # closed, or being answered with connection: close
            self._write_pending_answer()
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            # a request begins: no keep-alive timeout. A refused request's on_message_complete arms one, and
            # the next request can arrive in the same read (its head is parsed right after that body), so
            # data_received's own cancel has already run: without this, the timer closes the connection
            # under the next request, which then ends without an answer
            self._unset_keepalive_if_required()
            self._told_until = 0.0  # a Retry-After given before this request no longer stretches keep-alive
            self._head_begun = True
            self._requests_begun += 1
            if self._head_timer is None:
                self._arm_head_timer()

        def on_headers_complete(self) -> None:
            self._disarm_head_timer()
            self._head_begun = False
            if gate is not None and self._answered_on_head():
                return
            super().on_headers_complete()
            if self._draining and self.cycle is not None:
                self.cycle.keep_alive = False  # answered with "connection: close", then closed

        def _answered_on_head(self) -> bool:
            assert gate is not None
            if not self._idle():
                return False  # a pipelined request: the app answers in order
            if self.parser.get_method() != b"POST":
                return False
            parsed = httptools.parse_url(self.url)
            answer = gate(parsed.path.decode("latin-1"), parsed.query or b"", self.headers)
            if answer is None:
                return False
            if isinstance(answer, dict):  # let through, with what the gate holds for this request
                scope = cast(dict[str, Any], self.scope)  # uvicorn's HTTPScope: our own keys too
                scope.update(answer)
                self._gated_scope = scope
                return False
            self._discarding = True
            self._close_after = self.expect_100_continue or not self.parser.should_keep_alive()
            if self._draining:  # the last answer on this connection: say so
                answer = answer.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
                self._close_after = True
            if self.expect_100_continue:  # the client waits for us before sending a body: none will come
                self.transport.write(answer)
                self.transport.close()
            elif enforce_retry_after and (length := self._content_length()) is not None:
                # answered now; data_received splits the read where this body ends, so a request sent
                # right after the answer is held (not judged at once because it came in the body's read)
                self._body_left = length
                self._send_answer(answer)
            elif enforce_retry_after:
                # chunked: answered once the body is in (or after ANSWER_WAIT_S), so that a client sending
                # again at once starts its next request in a read of its own, which the hold can see
                self._pending_answer = answer
                self._answer_timer = self.loop.call_later(ANSWER_WAIT_S, self._write_pending_answer)
            else:
                self.transport.write(answer)
                self._note_retry_after(retry_after_of(answer))
            return True

        def _content_length(self) -> int | None:
            """The request's Content-Length, or None for a chunked (or malformed) body."""
            length = None
            for name, value in self.headers:
                if name == b"transfer-encoding":
                    return None
                if name == b"content-length":
                    try:
                        length = int(value)
                    except ValueError:
                        return None
            return length if length is not None and length >= 0 else None

        def _write_pending_answer(self) -> None:
            answer, self._pending_answer = self._pending_answer, None
            if self._answer_timer is not None:
                self._answer_timer.cancel()
                self._answer_timer = None
            if answer is not None:
                self._send_answer(answer)

        def _send_answer(self, answer: bytes) -> None:
            """Write a head refusal; the connection's next request is early until its Retry-After."""
            if self.transport.is_closing():
                return
            self.transport.write(answer)
            self._note_retry_after(retry_after_of(answer))
            self._retry_at = self._told_until

        def on_body(self, body: bytes) -> None:
            if not self._discarding:
                super().on_body(body)
            elif self._body_left is not None:
                self._body_left -= len(body)

        def on_message_complete(self) -> None:
            if not self._discarding:
                super().on_message_complete()
                return
            self._discarding = False
            self._body_left = None
            self._write_pending_answer()
            if self._close_after or self._draining:
                self.transport.close()
            elif not self.transport.is_closing():
                self._arm_keep_alive()

        def on_response_complete(self) -> None:
            # a 429 the app gave (after reading the body): this connection waits out its Retry-After too
            retry_after = self.scope.get(RETRY_AFTER_SCOPE_KEY)
            if isinstance(retry_after, float) and retry_after > 0:
                self._note_retry_after(retry_after)
                if enforce_retry_after:
                    self._retry_at = self._told_until
            super().on_response_complete()
            self._gated_request_done()
            if self.timeout_keep_alive_task is not None:  # armed by uvicorn: count it from the Retry-After
                self._arm_keep_alive()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            if self._drain_timer is not None:
                self._drain_timer.cancel()
                self._drain_timer = None
            if self._release_timer is not None:
                self._release_timer.cancel()
                self._release_timer = None
            if self._answer_timer is not None:
                self._answer_timer.cancel()
                self._answer_timer = None
            self._held = None
            self._pending_answer = None
            self._gated_request_done()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if not self._idle():
                return  # a request is being answered: its own limits apply
            if self._head_begun:
                body = json.dumps(
                    {
                        "error": {
                            "code": "header_timeout",
                            "message": f"the request head did not arrive within {header_timeout_s:g} s",
                            "request_id": sanitise_request_id(None),
                        }
                    }
                ).encode()
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
            self.transport.close()

    return HeaderTimeoutProtocol
