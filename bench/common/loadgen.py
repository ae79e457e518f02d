"""An HTTP load generator in its own process, so that its CPU time is its own and can be reported.

Clients share the 2 cores with the server; a load generator inside the bench process would mix its CPU with
the bench's model-only timings and hide how much of the machine the clients took. ``LoadGenerator`` starts
``python -m bench.common.loadgen`` once and sends it jobs over stdin/stdout (pickled frames); the child runs
each job with asyncio + httpx and answers with every request's start, latency and status, and the CPU time
it used during the run (``time.process_time`` around the run, start-up excluded).

Two shapes of load:
- closed loop (``LoadPlan(clients=N, duration_s=...)`` or ``count=...``): N clients, each with one request
  in flight on its own keep-alive connection, sending the next as soon as the last is answered;
- open loop (``LoadPlan(rate_per_s=R, duration_s=...)``): arrivals at a fixed rate whatever the answers,
  each on a connection of its own if needed (an overload that does not slow down when the server does).

``honour_retry_after``: a closed-loop client that gets a 429 with ``Retry-After`` waits that long before its
next request (a well-behaved client); without it, it retries at once (the overload stays).

    with LoadGenerator() as load:
        run = load.run(multipart_target(url, jpegs), LoadPlan(clients=8, duration_s=10))
        run.images_per_s, run.ok_latencies_s, run.client_cpu_cores
"""

from __future__ import annotations

import asyncio
import pickle
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
BOUNDARY = "vitembed-bench-6b1f0c"


@dataclass(frozen=True)
class Target:
    """What every request sends: ``bodies`` are used in turn (client i starts at body i)."""

    url: str
    bodies: tuple[bytes, ...]
    content_type: str
    headers: tuple[tuple[str, str], ...] = (("accept", "application/json"),)


def multipart_target(url: str, jpegs: Sequence[bytes], field_name: str = "image") -> Target:
    """Single-image multipart requests (``POST /v1/embed``, ``/v1/classify``, ...), one per JPEG."""

    def body(data: bytes) -> bytes:
        head = (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{field_name}"; filename="image.jpg"\r\n'
            "Content-Type: image/jpeg\r\n\r\n"
        ).encode()
        return head + data + f"\r\n--{BOUNDARY}--\r\n".encode()

    return Target(url, tuple(body(j) for j in jpegs), f"multipart/form-data; boundary={BOUNDARY}")


@dataclass(frozen=True)
class LoadPlan:
    """Closed loop (``clients``) unless ``rate_per_s`` is set; stops after ``duration_s`` or ``count``."""

    clients: int = 1
    duration_s: float | None = None
    count: int | None = None  # closed loop only: total requests over all clients
    rate_per_s: float | None = None  # open loop: arrivals per second
    honour_retry_after: bool = False
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.duration_s is None and (self.count is None or self.rate_per_s is not None):
            raise ValueError("a LoadPlan needs duration_s (or, closed loop only, count)")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")


@dataclass(frozen=True)
class RequestRecord:
    start_s: float  # since the run started
    latency_s: float
    status: int  # 0: transport error or timeout (no answer)
    retry_after_s: float | None = None


@dataclass
class LoadRun:
    plan: LoadPlan
    records: list[RequestRecord]
    wall_s: float  # run start to the last answer
    cpu_s: float  # the load generator's own CPU time during the run
    pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok_latencies_s(self) -> list[float]:
        return [r.latency_s for r in self.records if r.status == 200]

    @property
    def errors(self) -> int:
        return sum(1 for r in self.records if r.status != 200)

    @property
    def images_per_s(self) -> float:
        """200 answers per second (single-image requests: images per second)."""
        return len(self.ok_latencies_s) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def client_cpu_cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")

    def status_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for record in self.records:
            counts[record.status] = counts.get(record.status, 0) + 1
        return dict(sorted(counts.items()))


# ------------------------------------------------------------------------------------------------ parent side
class LoadGenerator:
    """The child process; ``run`` blocks until the job is done. Use as a context manager."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.common.loadgen"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, target: Target, plan: LoadPlan) -> LoadRun:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if stdin is None or stdout is None or self.proc.poll() is not None:
            raise RuntimeError("the load generator is not running (closed, or it exited)")
        _write_frame(stdin, (target, plan))
        answer = _read_frame(stdout)
        if answer is None:
            raise RuntimeError(f"the load generator exited with {self.proc.wait()}")
        if isinstance(answer, BaseException):
            raise RuntimeError(f"the load generator failed: {answer!r}") from answer
        run: LoadRun = answer
        run.pid = self.proc.pid
        return run

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()  # end of jobs
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_frame(stream: IO[bytes], value: object) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


# ------------------------------------------------------------------------------------------------ child side
async def _send(client: Any, target: Target, index: int, started: float) -> RequestRecord:
    import httpx

    headers = {"content-type": target.content_type, **dict(target.headers)}
    t0 = time.perf_counter()
    retry_after: float | None = None
    try:
        response = await client.post(
            target.url, content=target.bodies[index % len(target.bodies)], headers=headers
        )
        await response.aread()
        status = response.status_code
        if "retry-after" in response.headers:
            try:
                retry_after = float(response.headers["retry-after"])
            except ValueError:
                retry_after = None
    except httpx.HTTPError:
        status = 0
    return RequestRecord(t0 - started, time.perf_counter() - t0, status, retry_after)


async def _closed_loop(target: Target, plan: LoadPlan) -> tuple[list[RequestRecord], float]:
    import httpx

    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=plan.clients, max_keepalive_connections=plan.clients)
    remaining = [plan.count if plan.count is not None else -1]
    async with httpx.AsyncClient(timeout=plan.timeout_s, limits=limits) as client:
        started = time.perf_counter()
        deadline = started + plan.duration_s if plan.duration_s is not None else float("inf")

        async def one_client(slot: int) -> None:
            index = slot
            while time.perf_counter() < deadline and remaining[0] != 0:
                remaining[0] -= 1
                record = await _send(client, target, index, started)
                records.append(record)
                index += plan.clients
                if plan.honour_retry_after and record.status == 429 and record.retry_after_s:
                    await asyncio.sleep(min(record.retry_after_s, max(0.0, deadline - time.perf_counter())))

        await asyncio.gather(*(one_client(slot) for slot in range(plan.clients)))
    return records, started


async def _open_loop(
    target: Target, plan: LoadPlan, rate: float, duration_s: float
) -> tuple[list[RequestRecord], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=plan.timeout_s, limits=limits) as client:
        started = time.perf_counter()
        tasks = []
        for index in range(int(rate * duration_s)):
            delay = started + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_send(client, target, index, started)))
        records = list(await asyncio.gather(*tasks))
    return records, started


def _run_job(target: Target, plan: LoadPlan) -> LoadRun:
    cpu = time.process_time()
    if plan.rate_per_s is not None and plan.duration_s is not None:
        job = _open_loop(target, plan, plan.rate_per_s, plan.duration_s)
    else:
        job = _closed_loop(target, plan)
    records, started = asyncio.run(job)
    cpu_s = time.process_time() - cpu
    last = max((r.start_s + r.latency_s for r in records), default=time.perf_counter() - started)
    return LoadRun(plan, sorted(records, key=lambda r: r.start_s), last, cpu_s)


def serve_forever() -> None:
    """The child's loop: one (Target, LoadPlan) frame in, one LoadRun (or the exception) out, until EOF."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the frame stream
    while (job := _read_frame(stdin)) is not None:
        try:
            answer: object = _run_job(*job)
        except Exception as exc:  # reported to the parent, which raises
            answer = exc
        _write_frame(stdout, answer)


if __name__ == "__main__":
    from bench.common.loadgen import serve_forever as _serve  # the package's classes, not __main__'s

    _serve()
