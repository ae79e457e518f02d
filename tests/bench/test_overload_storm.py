"""The client side of ``bench/overload_storm.py`` against the floor server of ``bench/overload_floor.py`` on
127.0.0.1: every client joins at its slot of the ramp on a connection of its own, and its noted times are
in the order they happened."""

from __future__ import annotations

import asyncio

from bench.overload_floor import RefuseAll
from bench.overload_loadgen import multipart_request
from bench.overload_storm import Sent, storm


async def against_floor(clients: int, ramp: float) -> list[Sent]:
    server = await asyncio.get_running_loop().create_server(RefuseAll, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    payloads = [multipart_request(port, [bytes([seed]) * 200_000]) for seed in range(3)]
    try:
        return await asyncio.wait_for(storm(port, payloads, clients, ramp), 30)
    finally:
        server.close()


def test_each_client_joins_at_its_slot_of_the_ramp_and_notes_its_phases_in_order() -> None:
    sent = asyncio.run(against_floor(8, 0.4))
    assert sorted(s.joined for s in sent) == [0.4 * i / 8 for i in range(8)]
    assert len({s.port for s in sent}) == 8  # a connection each
    assert {s.status for s in sent} == {429}
    for s in sent:
        assert s.began <= s.connected <= s.drained <= s.answered
    first = min(sent, key=lambda s: s.joined)
    last = max(sent, key=lambda s: s.joined)
    assert last.began - first.began >= 0.3  # the last joined ~0.35 s after the first, not at once
