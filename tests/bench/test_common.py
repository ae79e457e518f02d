"""Shared bench helpers: the load generator process against a real local HTTP server; the report writer."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from bench.common.loadgen import LoadGenerator, LoadPlan, multipart_target
from bench.common.report import RESULTS, output_dir, to_jsonable, write_report


class _Handler(BaseHTTPRequestHandler):
    seen: list[bytes]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        if self.path == "/busy":
            self.send_response(429)
            self.send_header("Retry-After", "1")
        else:
            self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def load() -> Iterator[LoadGenerator]:
    with LoadGenerator() as generator:
        yield generator


def _url(server: ThreadingHTTPServer, path: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_closed_loop_sends_count_requests_in_its_own_process(
    http_server: ThreadingHTTPServer, load: LoadGenerator
) -> None:
    target = multipart_target(_url(http_server, "/ok"), [b"first", b"second"])
    run = load.run(target, LoadPlan(clients=2, count=6))
    assert run.status_counts() == {200: 6}
    assert len(http_server.seen) == 6  # type: ignore[attr-defined]
    # each client cycles the bodies from its own slot (0: first, 1: second); how many requests each of the
    # two sends out of the shared count of 6 depends on which answers come back first
    firsts = sum(b"first" in body for body in http_server.seen)  # type: ignore[attr-defined]
    assert 1 <= firsts <= 5
    assert run.pid == load.pid != os.getpid()
    assert run.cpu_s > 0 and run.wall_s > 0
    assert run.images_per_s == pytest.approx(6 / run.wall_s)


def test_open_loop_sends_rate_times_duration(http_server: ThreadingHTTPServer, load: LoadGenerator) -> None:
    target = multipart_target(_url(http_server, "/ok"), [b"x"])
    run = load.run(target, LoadPlan(rate_per_s=20, duration_s=0.5))
    assert len(run.records) == 10 == len(http_server.seen)  # type: ignore[attr-defined]
    starts = [r.start_s for r in run.records]
    assert starts == sorted(starts) and starts[-1] >= 9 / 20  # arrivals follow the schedule, not the answers


def test_retry_after_is_honoured_only_when_asked(
    http_server: ThreadingHTTPServer, load: LoadGenerator
) -> None:
    target = multipart_target(_url(http_server, "/busy"), [b"x"])
    polite = load.run(target, LoadPlan(clients=1, duration_s=1.0, honour_retry_after=True))
    assert [r.status for r in polite.records] == [429]  # waited the 1 s Retry-After: the run was over
    assert polite.records[0].retry_after_s == 1.0
    rude = load.run(target, LoadPlan(clients=1, duration_s=1.0))
    assert len(rude.records) > 2 and rude.errors == len(rude.records)


def test_a_plan_without_an_end_is_refused() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        LoadPlan(clients=2)
    with pytest.raises(ValueError, match="duration_s"):
        LoadPlan(rate_per_s=5, count=10)


def test_reports_are_json_safe_and_quick_runs_never_write_into_bench_results(tmp_path: Path) -> None:
    import argparse

    assert to_jsonable({"a": math.nan, "b": np.float32(1.5), "c": (Path("/x"), np.arange(2))}) == {
        "a": None,
        "b": 1.5,
        "c": ["/x", [0, 1]],
    }
    quick = output_dir(argparse.Namespace(quick=True, out=None), "demo")
    assert quick != RESULTS and quick.is_dir() and not any(quick.iterdir())
    json_path, md_path = write_report(tmp_path, "demo", {"x": math.inf}, "# Demo")
    assert json.loads(json_path.read_text()) == {"x": None}
    assert md_path.read_text() == "# Demo\n"
