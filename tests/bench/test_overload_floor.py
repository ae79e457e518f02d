"""The floor server of ``bench/overload_floor.py``: one 429 per request as soon as its head is in, however
the bytes are split across reads, with each body read and dropped (so keep-alive requests stay framed)."""

from __future__ import annotations

from bench.overload_floor import REFUSAL, RefuseAll


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def request(body: bytes) -> bytes:
    return (
        b"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def test_each_request_gets_one_refusal_once_its_head_is_in() -> None:
    protocol = RefuseAll()
    transport = Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    first, second = request(b"a" * 1000), request(b"\r\n\r\n" * 10)  # a body that looks like a head's end
    wire = first + second + request(b"")
    cut = first.index(b"\r\n\r\n") + 2  # the first head split in the middle of its end
    protocol.data_received(wire[:cut])
    assert transport.written == []
    protocol.data_received(wire[cut : cut + 10])
    assert transport.written == [REFUSAL]  # answered before its body has arrived
    for start in range(cut + 10, len(wire), 7):
        protocol.data_received(wire[start : start + 7])
    assert transport.written == [REFUSAL] * 3
    assert protocol.body_left is None and protocol.head == b""
