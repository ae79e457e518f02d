"""The load generator of ``bench/overload.py``, run as its own process (its CPU time is measured there and
reported, since it shares the machine's cores with the server).

asyncio with raw HTTP/1.1 on keep-alive connections, so that one process can keep hundreds of clients
going at a small CPU cost. Modes: closed-loop groups of clients (back to back; optionally honouring
``Retry-After``), open-loop Poisson arrivals, and a fixed count of requests. Scenario JSON on stdin,
records and this process's CPU seconds as JSON on stdout:

    python -m bench.overload_loadgen groups < spec.json  # {"port", "payloads" (hex), "groups", "seed"}
    python -m bench.overload_loadgen count < spec.json  # {"port", "payloads", "clients", "per_client"}
"""

from __future__ import annotations

import asyncio
import io
import json
import random
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

HOST = "127.0.0.1"
BOUNDARY = "vitembedoverloadbench"


# ------------------------------------------------------------------------------------------- requests
def jpeg_noise(width: int, height: int, seed: int, quality: int = 90) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, "JPEG", quality=quality
    )
    return buffer.getvalue()


def multipart_request(port: int, images: Sequence[bytes], *, fields: dict[str, str] | None = None) -> bytes:
    """The bytes of one ``POST /v1/embed`` (multipart) on the wire."""
    parts = []
    for name, value in (fields or {}).items():
        parts.append(
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        )
    for data in images:
        parts.append(
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="image"; filename="x.jpg"\r\n'
            "Content-Type: image/jpeg\r\n\r\n".encode()
            + data
            + b"\r\n"
        )
    body = b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()
    head = (
        f"POST /v1/embed HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


# ------------------------------------------------------------------------------------------- load generator
@dataclass
class Group:
    """Clients of one kind: closed loop (``clients`` connections, back to back) or open loop (``rate``
    Poisson arrivals per second, each on a free connection or a new one)."""

    name: str
    clients: int = 0
    rate: float = 0.0
    start_s: float = 0.0
    duration_s: float = 10.0
    honour_retry_after: bool = False
    # closed loop only: at the end of its duration a client drops the request it has in flight (closes its
    # connection) instead of waiting for the answer: the callers of a flood that stops go away
    leave_at_stop: bool = False


ABANDONED = -1  # a Record's status when its client closed the connection at its group's stop


@dataclass
class Record:
    group: str
    start: float  # seconds since the scenario began
    end: float
    status: int  # 0: the connection failed; ABANDONED: dropped by its client at the group's stop
    retry_after: float | None
    # sent on a connection before the Retry-After of its last 429 had passed (a client ignoring it); a server
    # that enforces Retry-After holds such a request until then, so its latency is reported apart
    early: bool = False


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.refused_until = 0.0  # scenario time until which the last 429's Retry-After runs

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(HOST, port, limit=1 << 20)
        return cls(reader, writer)

    async def request(self, payload: bytes) -> tuple[int, dict[str, str]]:
        self.writer.write(payload)
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        await self.reader.readexactly(int(headers.get("content-length", "0")))
        return status, headers

    def close(self) -> None:
        self.writer.close()


async def _one(
    port: int, conn: Connection | None, payload: bytes
) -> tuple[Connection | None, int, dict[str, str]]:
    """One request; a fresh connection when there is none or the server closed it. (conn, status, headers)"""
    for _ in range(2):
        try:
            if conn is None:
                conn = await Connection.open(port)
            status, headers = await conn.request(payload)
            if headers.get("connection", "").lower() == "close":
                conn.close()
                conn = None
            return conn, status, headers
        except asyncio.CancelledError:  # the client leaves: its connection goes with it
            if conn is not None:
                conn.close()
            raise
        except (OSError, asyncio.IncompleteReadError, ValueError):
            if conn is not None:
                conn.close()
            conn = None
    return None, 0, {}


async def run_groups(port: int, payloads: list[bytes], groups: list[Group], seed: int) -> list[Record]:
    records: list[Record] = []
    t0 = time.monotonic()
    rng = random.Random(seed)

    def now() -> float:
        return time.monotonic() - t0

    async def closed_client(group: Group, index: int) -> None:
        await asyncio.sleep(group.start_s)
        conn: Connection | None = None
        k = index
        stop_at = group.start_s + group.duration_s
        refused_until = 0.0
        while now() < stop_at:
            began = now()
            early = began < refused_until
            request = _one(port, conn, payloads[k % len(payloads)])
            if group.leave_at_stop:
                try:
                    conn, status, headers = await asyncio.wait_for(request, stop_at - began)
                except asyncio.TimeoutError:  # _one closed the connection
                    records.append(Record(group.name, began, now(), ABANDONED, None, early))
                    return
            else:
                conn, status, headers = await request
            k += len(payloads) // 2 + 1
            retry = float(headers["retry-after"]) if "retry-after" in headers else None
            records.append(Record(group.name, began, now(), status, retry, early))
            refused_until = now() + retry if status == 429 and retry is not None else 0.0
            if status == 429 and group.honour_retry_after and retry is not None:
                await asyncio.sleep(min(retry, max(0.0, stop_at - now())))
        if conn is not None:
            conn.close()

    async def open_loop(group: Group) -> None:
        await asyncio.sleep(group.start_s)
        idle: list[Connection] = []
        tasks: set[asyncio.Task[None]] = set()
        stop_at = group.start_s + group.duration_s
        next_at = group.start_s
        k = 0

        async def arrival(payload: bytes) -> None:
            conn = idle.pop() if idle else None
            began = now()
            early = conn is not None and began < conn.refused_until
            conn, status, headers = await _one(port, conn, payload)
            retry = float(headers["retry-after"]) if "retry-after" in headers else None
            records.append(Record(group.name, began, now(), status, retry, early))
            if conn is not None:
                conn.refused_until = now() + retry if status == 429 and retry is not None else 0.0
                idle.append(conn)

        while True:
            next_at += rng.expovariate(group.rate)
            if next_at >= stop_at:
                break
            await asyncio.sleep(max(0.0, next_at - now()))
            task = asyncio.ensure_future(arrival(payloads[k % len(payloads)]))
            k += 1
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        for conn in idle:
            conn.close()

    jobs = []
    for group in groups:
        if group.rate > 0:
            jobs.append(open_loop(group))
        else:
            jobs.extend(closed_client(group, i) for i in range(group.clients))
    await asyncio.gather(*jobs)
    return records


def loadgen_main() -> None:
    """``groups``: scenario JSON on stdin → records and this process's CPU seconds on stdout."""
    spec = json.load(sys.stdin)
    payloads = [bytes.fromhex(p) for p in spec["payloads"]]
    groups = [Group(**g) for g in spec["groups"]]
    before = _cpu_s()
    records = asyncio.run(run_groups(spec["port"], payloads, groups, spec.get("seed", 0)))
    cpu = _cpu_s() - before
    json.dump({"records": [asdict(r) for r in records], "cpu_s": cpu}, sys.stdout)


def loadgen_count_main() -> None:
    spec = json.load(sys.stdin)
    payloads = [bytes.fromhex(p) for p in spec["payloads"]]
    records: list[Record] = []

    async def client(index: int) -> None:
        conn: Connection | None = None
        t0 = time.monotonic()
        for k in range(spec["per_client"]):
            began = time.monotonic() - t0
            conn, status, _ = await _one(
                spec["port"], conn, payloads[(spec["seed"] + index * 7 + k) % len(payloads)]
            )
            records.append(Record("m", began, time.monotonic() - t0, status, None))
        if conn is not None:
            conn.close()

    async def main() -> None:
        await asyncio.gather(*(client(i) for i in range(spec["clients"])))

    before = _cpu_s()
    asyncio.run(main())
    cpu = _cpu_s() - before
    json.dump({"records": [asdict(r) for r in records], "cpu_s": cpu}, sys.stdout)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    {"groups": loadgen_main, "count": loadgen_count_main}[sys.argv[1]]()
