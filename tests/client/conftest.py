"""Fixtures for the client tests: real ``vitembed serve`` processes on 127.0.0.1 serving the tiny random-init
DINOv2 (float32, so the client's numbers equal the library's to 1e-5), the library on the same checkpoint,
and small JPEG photographs."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from vit_backbone import Backbone, load_backbone

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


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["dinov2"]


@pytest.fixture(scope="session")
def reference(tiny_path: Path) -> Backbone:
    return load_backbone(tiny_path)


@pytest.fixture(scope="session")
def server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Default limits; a batch waits up to 20 ms to fill."""
    started = start_server(tiny_path, tmp_path_factory.mktemp("client-serve"), "--max-wait-ms", "20")
    yield started
    started.stop()


@pytest.fixture(scope="session")
def flood_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = start_server(tiny_path, tmp_path_factory.mktemp("client-flood"), *FLOOD_FLAGS, api_key=API_KEY)
    yield started
    started.stop()


@pytest.fixture(scope="session")
def photos(sample_images: list[Any]) -> list[bytes]:
    """24 distinct small JPEGs: the four bundled photographs at six sizes."""
    out = []
    for width, height in ((64, 48), (80, 96), (120, 72), (57, 101), (96, 96), (140, 60)):
        for image in sample_images:
            buffer = io.BytesIO()
            image.resize((width, height)).save(buffer, format="JPEG", quality=90)
            out.append(buffer.getvalue())
    return out


@pytest.fixture(scope="session")
def write_files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[bytes]], list[Path]]:
    folder = tmp_path_factory.mktemp("photos")

    def write(images: list[bytes]) -> list[Path]:
        paths = [folder / f"{i}.jpg" for i in range(len(images))]
        for path, data in zip(paths, images, strict=True):
            path.write_bytes(data)
        return paths

    return write
