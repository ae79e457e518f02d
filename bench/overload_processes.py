"""The processes of ``bench/overload.py``: the server under test, the spinning neighbour, the load generator
(its own process, ``bench/overload_loadgen.py``), and what each used."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from bench.common.machine import process_cpu_seconds, process_rss_bytes
from bench.common.server import free_port
from bench.overload_loadgen import HOST, Group, Record

ROOT = Path(__file__).resolve().parents[1]
LOADGEN = [sys.executable, "-m", "bench.overload_loadgen"]  # run from ROOT


def rss_mib(pid: int) -> float:
    return process_rss_bytes(pid) / 2**20


cpu_seconds = process_cpu_seconds


@contextmanager
def server(
    model: str,
    log_path: Path,
    *flags: str,
    torch_threads: int | None = None,
    launcher: Sequence[str] = ("-m", "vitembed"),
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``vitembed serve`` on a free port, ready; ``launcher``: the interpreter's arguments before ``serve``
    (``("-c", code)`` runs a patched server, as ``bench/overload_storm.py`` does)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITEMBED_")}
    if torch_threads:
        env["VITEMBED_TORCH_THREADS"] = str(torch_threads)
    command = [sys.executable, *launcher, "serve", "--model", model, "--port", str(port), *flags]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited: {log_path.read_text()[-2000:]}")
                try:
                    with socket.create_connection((HOST, port), timeout=1) as sock:
                        sock.sendall(
                            f"GET /ready HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
                        )
                        if b" 200 " in sock.recv(64):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.2)
            yield proc, port
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def neighbour(enabled: bool) -> Iterator[int | None]:
    """One process spinning on one core for the whole block; yields its pid."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _loadgen(
    mode: str, port: int, payloads: list[bytes], seed: int, **spec: object
) -> tuple[list[Record], float]:
    """Run the load generator process in ``mode``: its records and its own CPU seconds."""
    spec.update(port=port, payloads=[p.hex() for p in payloads], seed=seed)
    done = subprocess.run(
        [*LOADGEN, mode], cwd=ROOT, input=json.dumps(spec).encode(), capture_output=True, check=True
    )
    out = json.loads(done.stdout)
    return [Record(**r) for r in out["records"]], float(out["cpu_s"])


def run_loadgen(
    port: int, payloads: list[bytes], groups: list[Group], seed: int = 0
) -> tuple[list[Record], float]:
    return _loadgen("groups", port, payloads, seed, groups=[asdict(g) for g in groups])


def count_requests(
    port: int, payloads: list[bytes], clients: int, per_client: int, seed: int
) -> tuple[list[Record], float]:
    """A fixed number of requests (``clients`` x ``per_client``), through the load generator process."""
    return _loadgen("count", port, payloads, seed, clients=clients, per_client=per_client)
