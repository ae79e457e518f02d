"""Real ``vitembed serve`` processes on 127.0.0.1 for the client tests (imported by tests/client/conftest.py
and the tests; a module name of its own, since every test folder has a ``conftest``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"  # loopback only, always
READY_TIMEOUT_S = 60.0
API_KEY = "client-test-key"
# The flood server: its queue holds one request of FLOOD_IMAGES images and fewer images than one batch, so
# every admitted request waits the batch timer and the others are refused with 429 and Retry-After.
FLOOD_IMAGES = 4
FLOOD_FLAGS = (
    "--queue-size", str(FLOOD_IMAGES),
    "--max-images-per-request", str(FLOOD_IMAGES),
    "--max-batch-size", "8",
    "--max-wait-ms", "150",
)  # fmt: skip


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(35)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def status_count(self, status: int) -> float:
        """Answers with ``status`` on /v1/embed so far (the server's own Prometheus counter)."""
        text = httpx.get(f"{self.url}/metrics", trust_env=False).text
        total = 0.0
        for line in text.splitlines():
            if (
                line.startswith("vitembed_requests_total{")
                and f'status="{status}"' in line
                and "/v1/embed" in line
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def start_server(model: Path, log_dir: Path, *flags: str, api_key: str | None = None) -> ServerProcess:
    port = _free_port()
    log_path = log_dir / f"serve-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITEMBED_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VITEMBED_TORCH_THREADS="1")
    if api_key is not None:
        env["VITEMBED_API_KEY"] = api_key
    command = [
        sys.executable, "-m", "vitembed", "serve", "--model", f"tiny={model}",
        "--host", HOST, "--port", str(port), "--precision", "float32", *flags,
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )
    server = ServerProcess(proc, f"http://{HOST}:{port}", log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vitembed serve exited with {proc.returncode} before ready:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=2.0, trust_env=False).status_code == 200:
                return server
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.1)
    server.stop()
    pytest.fail(f"vitembed serve not ready within {READY_TIMEOUT_S:g} s:\n{server.log()}")
