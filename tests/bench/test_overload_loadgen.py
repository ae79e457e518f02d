"""The overload bench's load generator against a tiny asyncio server on 127.0.0.1 that answers only the
requests marked ``fast`` and never the others: a group that leaves at its stop drops the request it has in
flight and closes its connection (so the server sees the callers go), one that does not waits for the
answer; the records name each outcome."""

from __future__ import annotations

import asyncio

from bench.overload_loadgen import ABANDONED, Group, run_groups

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"


async def run(groups: list[Group], payload: bytes) -> tuple[list[int], int, int]:
    """(the statuses recorded, connections the server saw, connections closed by their clients)"""
    seen = closed = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen, closed
        seen += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                if await reader.readexactly(length) == b"fast":
                    writer.write(OK)
                else:  # never answered: wait for the client to go
                    await reader.read()
                    break
        except (asyncio.IncompleteReadError, ConnectionResetError):  # the client went between requests
            pass
        closed += 1
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    records = await asyncio.wait_for(run_groups(port, [payload], groups, seed=0), 10)
    for _ in range(100):  # the server's side of the closes
        if closed == seen:
            break
        await asyncio.sleep(0.01)
    server.close()
    return [r.status for r in records], seen, closed


def request(body: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def test_a_group_that_leaves_at_its_stop_drops_its_request_in_flight_and_its_connection() -> None:
    statuses, seen, closed = asyncio.run(
        run([Group("flood", clients=3, duration_s=0.3, leave_at_stop=True)], request(b"slow"))
    )
    assert statuses == [ABANDONED] * 3
    assert (seen, closed) == (3, 3)


def test_a_group_that_stays_waits_for_its_answers() -> None:
    async def stays() -> bool:
        task = asyncio.ensure_future(run([Group("flood", clients=2, duration_s=0.3)], request(b"slow")))
        await asyncio.sleep(1.0)
        done = task.done()
        task.cancel()
        return done

    assert not asyncio.run(stays())  # still waiting well past its stop


def test_answered_requests_are_recorded_back_to_back_until_the_stop() -> None:
    statuses, seen, closed = asyncio.run(run([Group("steady", clients=2, duration_s=0.3)], request(b"fast")))
    assert len(statuses) > 10 and set(statuses) == {200}
    assert (seen, closed) == (2, 2)  # one keep-alive connection per client, closed at the end
