"""Where the time of a storm's 429s goes: the client's connect, write and drain, the server's accept, first
read and answer, per refused request.

A diagnostic, not a bench with a bar. ``vitembed serve`` (embedded default, server defaults) runs in a
process of its own with uvicorn's httptools protocol patched to note, per connection, when
``connection_made`` ran (the connection was accepted) and when its first bytes were read; the clients
(``--clients``, one request each, joining evenly over ``--ramp`` seconds, each on a connection of its own)
note when they connected, when their body was written and drained, and when the answer's head came. Both
use CLOCK_MONOTONIC and are matched by the client's port. Optionally the server runs on asyncio's loop
instead of uvloop (``--loop asyncio``), listens on several SO_REUSEPORT sockets (``--listeners N``) or
with uvicorn's own listener instead of the server's accept loop (``--uvicorn-accept``).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.overload_storm [--clients 512] [--ramp 1.0]
        [--loop asyncio] [--listeners N] [--uvicorn-accept]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.overload_loadgen import HOST, Group, jpeg_noise, multipart_request
from bench.overload_processes import run_loadgen, server


# ------------------------------------------------------------------------------------------- the server side
def serve_noting_connections(
    out: str, loop: str | None, listeners: int, own_accept: bool, argv: list[str]
) -> None:
    """``vitembed serve`` with each connection's accept and first read noted, written to ``out`` at exit."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    made: dict[int, float] = {}
    first: dict[int, float] = {}
    base_made, base_received = HttpToolsProtocol.connection_made, HttpToolsProtocol.data_received

    def connection_made(self: Any, transport: Any) -> None:
        self._storm_port = transport.get_extra_info("peername")[1]
        made[self._storm_port] = time.monotonic()
        base_made(self, transport)

    def data_received(self: Any, data: bytes) -> None:
        first.setdefault(self._storm_port, time.monotonic())
        base_received(self, data)

    HttpToolsProtocol.connection_made = connection_made  # type: ignore[method-assign]
    HttpToolsProtocol.data_received = data_received  # type: ignore[method-assign]
    from vitembed.server import acceptor

    own_run = acceptor.run_server

    def run_server(config: uvicorn.Config) -> None:
        if loop:
            config.loop = loop
        if not own_accept or listeners > 1:  # uvicorn's own listeners: libuv accepts on uvloop
            sockets = []
            for _ in range(listeners if listeners > 1 else 0):  # bound; uvicorn listens once the app is up
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((config.host, config.port))
                sockets.append(sock)
            uvicorn.Server(config).run(sockets=sockets or None)
            return
        own_run(config)

    acceptor.run_server = run_server
    from vitembed.cli.main import main

    try:
        main(argv)
    finally:
        Path(out).write_text(json.dumps({"made": made, "first": first}))


# ------------------------------------------------------------------------------------------- the client side
@dataclass
class Sent:
    joined: float  # seconds after the storm began at which this client was due
    port: int
    status: int
    began: float  # CLOCK_MONOTONIC
    connected: float
    drained: float
    answered: float


async def one_client(port: int, payload: bytes, delay: float, out: list[Sent]) -> None:
    await asyncio.sleep(delay)
    began = time.monotonic()
    reader, writer = await asyncio.open_connection(HOST, port, limit=1 << 20)
    connected = time.monotonic()
    writer.write(payload)
    await writer.drain()
    drained = time.monotonic()
    head = await reader.readuntil(b"\r\n\r\n")
    answered = time.monotonic()
    mine = writer.get_extra_info("sockname")[1]
    out.append(Sent(delay, mine, int(head.split()[1]), began, connected, drained, answered))
    await asyncio.sleep(3.0)  # the connection stays open until every client is answered
    writer.close()


async def storm(port: int, payloads: list[bytes], clients: int, ramp: float) -> list[Sent]:
    out: list[Sent] = []
    await asyncio.gather(
        *(one_client(port, payloads[i % len(payloads)], ramp * i / clients, out) for i in range(clients))
    )
    return out


def ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):6.1f} / {1000 * max(values):6.1f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds over which the clients join")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default=None)
    parser.add_argument(
        "--listeners", type=int, default=1, help="SO_REUSEPORT listening sockets (uvicorn's own listeners)"
    )
    parser.add_argument(
        "--uvicorn-accept",
        action="store_true",
        help="uvicorn's own listener (on uvloop, libuv takes one connection per wake-up) instead of the "
        "server's accept loop",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        noted = Path(tmp) / "connections.json"
        code = (
            "import sys; from bench.overload_storm import serve_noting_connections as s; "
            f"s({str(noted)!r}, {args.loop!r}, {args.listeners}, {not args.uvicorn_accept}, sys.argv[1:])"
        )
        with server("embedded=embedded", Path(tmp) / "serve.log", launcher=("-c", code)) as (_, port):
            payloads = [multipart_request(port, [jpeg_noise(640, 480, seed)]) for seed in range(16)]
            run_loadgen(port, payloads, [Group("warm-up", clients=32, duration_s=8)])
            time.sleep(2.0)
            sent = asyncio.run(storm(port, payloads, args.clients, args.ramp))
        noted_times = json.loads(noted.read_text())
    made = {int(k): v for k, v in noted_times["made"].items()}
    first = {int(k): v for k, v in noted_times["first"].items()}
    refused = sorted((s for s in sent if s.status == 429 and s.port in made and s.port in first),
                     key=lambda s: s.joined)  # fmt: skip
    answers = sorted(s.answered - s.began for s in refused)
    if args.listeners > 1:
        accepting = f"uvicorn's listeners, {args.listeners} with SO_REUSEPORT"
    else:
        # on asyncio's loop the server keeps uvicorn's listener (it takes up to the backlog per wake-up)
        own = not args.uvicorn_accept and args.loop != "asyncio"
        accepting = "the server's accept loop" if own else "uvicorn's listener"
    print(
        f"{args.clients} clients over {args.ramp:g} s (loop {args.loop or 'uvicorn default'}, "
        f"{accepting}): {len(refused)} refused; 429 from request start p50 "
        f"{1000 * statistics.median(answers):.0f} ms, p99 {1000 * answers[int(0.99 * len(answers))]:.0f} ms"
    )
    print("joined at | n | connect | write+drain | accept after connect | first read after accept | "
          "answer after first read (ms, median / max)")  # fmt: skip
    slots = 10
    for slot in range(slots):
        low, high = args.ramp * slot / slots, args.ramp * (slot + 1) / slots
        rows = [s for s in refused if low <= s.joined < high or (args.ramp == 0 and slot == 0)]
        if rows:
            print(
                f"{low:5.2f} s | {len(rows):3d} | {ms([s.connected - s.began for s in rows])} | "
                f"{ms([s.drained - s.connected for s in rows])} | "
                f"{ms([made[s.port] - s.connected for s in rows])} | "
                f"{ms([first[s.port] - made[s.port] for s in rows])} | "
                f"{ms([s.answered - first[s.port] for s in rows])}"
            )


if __name__ == "__main__":
    main()
