"""``vitembed serve`` as a subprocess on 127.0.0.1, as a user runs it; its /metrics and its memory.

with ServerProcess(["--max-wait-ms", "10"], log_path=work / "server.log") as server:
    server.wait_ready(300)
    before = server.metrics()
    ...
    stages = metrics_delta(before, server.metrics(), seconds=wall)
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from .machine import process_rss_bytes

ROOT = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (metric name, sorted labels) → value
STAGES = ("decode", "preprocess", "queue", "forward", "serialise")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """Started on construction; stopped with SIGTERM (graceful drain), then killed after 40 s."""

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cpus: str | None = None,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "vitembed", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        command += [*extra_args, "--log-level", "warning"]
        if cpus:
            command = ["taskset", "-c", cpus, *command]  # taskset execs: the pid stays the server's
        self.command = command
        self.env = dict(env or {})
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``/ready`` answered 200."""
        started = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() - started < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.base}/ready").status_code == 200:
                        return time.monotonic() - started
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def model_info(self) -> dict[str, Any]:
        """The first served model's ``/v1/models`` entry (its ``info`` holds the precision chosen)."""
        models = httpx.get(f"{self.base}/v1/models", timeout=10).json()
        return dict(models["data"][0])

    def metrics(self) -> Samples:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
        return samples

    def rss_bytes(self) -> int:
        return process_rss_bytes(self.proc.pid)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def subtract(after: Samples, before: Samples) -> Samples:
    """Counter deltas between two scrapes (sum several deltas with ``add``)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def add(total: Samples, delta: Samples) -> Samples:
    return {key: total.get(key, 0.0) + delta.get(key, 0.0) for key in {*total, *delta}}


def metrics_delta(delta: Samples, seconds: float, model: str = "embedded") -> dict[str, Any]:
    """What /metrics says about one scenario (``delta`` = after − before): forward passes, batch-size
    histogram, per-stage mean ms and busy fraction (stage-seconds per wall second), refusals by reason."""

    def value(name: str, **labels: str) -> float:
        return delta.get((name, tuple(sorted(labels.items()))), 0.0)

    buckets: dict[str, int] = {}
    previous = 0.0
    bucket_keys = sorted(
        (float(dict(labels)["le"]), dict(labels)["le"])
        for (name, labels) in delta
        if name == "vitembed_batch_size_bucket" and dict(labels).get("model") == model
    )
    for _, le in bucket_keys:
        cumulative = value("vitembed_batch_size_bucket", le=le, model=model)
        if cumulative - previous:
            buckets[f"<={le}"] = round(cumulative - previous)
        previous = cumulative
    passes = value("vitembed_batch_size_count", model=model)
    out: dict[str, Any] = {
        "forward_passes": int(passes),
        "mean_batch_size": value("vitembed_batch_size_sum", model=model) / passes if passes else math.nan,
        "batch_size_histogram": buckets,
    }
    for stage in STAGES:
        total = value("vitembed_stage_seconds_sum", stage=stage)
        count = value("vitembed_stage_seconds_count", stage=stage)
        out[f"{stage}_mean_ms"] = 1000 * total / count if count else math.nan
        out[f"{stage}_busy"] = total / seconds if seconds else math.nan
    rejected: dict[str, int] = {}
    for (name, labels), v in delta.items():
        if name == "vitembed_rejected_total" and v:
            reason = dict(labels).get("reason", "?")
            rejected[reason] = rejected.get(reason, 0) + int(v)
    out["rejected"] = rejected
    return out
