"""The floor under the overload bench's opening storm: how fast can any server answer it on this machine?

At the start of a closed-loop scenario of ``bench/overload.py`` every client connects and sends its first
276 kB request in the same instant, and the 429 latency is measured from each request's start. Part of that
time is the load generator's own (256 connections opened and 71 MB written by one asyncio process) and the
kernel's, on the same 2 cores as the server. This bench measures that part: the same load generator and
payloads against a server that does nothing but answer every request ``429`` from its head (and read and
drop the body, as ``vitembed serve`` does to keep the connection), in a process of its own (uvloop, as
uvicorn uses). Each client sends one request; reported: p50 / p99 / max of those answers, quiet and beside
one process spinning on one core.

    python -m bench.overload_floor [--clients 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

from bench.common.server import free_port
from bench.overload import pct
from bench.overload_loadgen import jpeg_noise, multipart_request
from bench.overload_processes import count_requests, neighbour

BODY = b'{"error":{"code":"overloaded","message":"the floor server refuses everything","request_id":"-"}}'
REFUSAL = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(BODY)).encode()
    + b"\r\nretry-after: 1\r\n\r\n"
    + BODY
)


class RefuseAll(asyncio.Protocol):
    """Answers each request 429 as soon as its head is in; reads its body (Content-Length) and drops it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.head = b""
        self.body_left: int | None = None

    def data_received(self, data: bytes) -> None:
        while data:
            if self.body_left is None:
                self.head += data
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, data, self.head = self.head[:end].lower(), self.head[end + 4 :], b""
                start = head.find(b"content-length:")
                self.body_left = int(head[start + 15 :].split(b"\r\n")[0]) if start >= 0 else 0
                self.transport.write(REFUSAL)
            taken = min(self.body_left, len(data))
            self.body_left -= taken
            data = data[taken:]
            if self.body_left == 0:
                self.body_left = None


def serve_refusals(port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(RefuseAll, "127.0.0.1", port, backlog=2048)
        await server.serve_forever()

    asyncio.run(main())


def storm(port: int, payloads: list[bytes], clients: int) -> list[float]:
    """Seconds to each client's one 429 (every client connects and sends one request at once)."""
    records, _ = count_requests(port, payloads, clients, 1, 0)
    return [r.end - r.start for r in records if r.status == 429]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(target=serve_refusals, args=(port,), daemon=True)
    process.start()
    time.sleep(1.0)
    payloads = [multipart_request(port, [jpeg_noise(640, 480, seed)]) for seed in range(16)]
    try:
        for busy in (False, True):
            with neighbour(busy):
                p99s = []
                for _ in range(args.repeats):
                    seconds = storm(port, payloads, args.clients)
                    p99s.append(1000 * pct(seconds, 99))
                    print(
                        f"{'busy' if busy else 'quiet'}: {len(seconds)} of {args.clients} answered 429; "
                        f"p50 / p99 / max {1000 * pct(seconds, 50):.0f} / {p99s[-1]:.0f} / "
                        f"{1000 * max(seconds):.0f} ms",
                        flush=True,
                    )
                    time.sleep(1.0)
                label = "busy" if busy else "quiet"
                print(f"{label}: median p99 {statistics.median(p99s):.0f} ms", flush=True)
    finally:
        process.terminate()
        process.join(10)


if __name__ == "__main__":
    main()
