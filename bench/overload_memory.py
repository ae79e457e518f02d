"""The memory part of ``bench/overload.py``: the server's RSS after 1,000 and after 10,000 requests of mixed
sizes and counts (some invalid), on a tiny random-init model so that it takes a minute."""

from __future__ import annotations

import importlib.util
import random
import tempfile
from pathlib import Path
from typing import Any

from bench.overload_loadgen import jpeg_noise, multipart_request
from bench.overload_processes import ROOT, count_requests, rss_mib, server


def memory_suite(quick: bool, torch_threads: int | None = None) -> dict[str, Any]:
    """RSS after 1,000 and after 10,000 requests of mixed sizes (some invalid), tiny random-init model."""
    make_tiny_checkpoint = _tests_conftest().make_tiny_checkpoint  # the tests' tiny checkpoints: no downloads

    total, first = (2_000, 200) if quick else (10_000, 1_000)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_checkpoint("dinov2", Path(tmp) / "tiny")
        with server(
            f"tiny={folder}", Path(tmp) / "serve.log", "--precision", "float32", torch_threads=torch_threads
        ) as (proc, port):
            rng = random.Random(0)
            good = [
                jpeg_noise(w, h, s) for s, (w, h) in enumerate([(64, 64), (160, 120), (320, 240), (640, 480)])
            ]
            bad = [good[0][: len(good[0]) // 2], b"not an image at all", b""]
            payloads = []
            for i in range(64):
                count = rng.choice([1, 1, 1, 2, 4, 8])
                images = [rng.choice(good) for _ in range(count)]
                fields = {"pooling": "patch"} if i % 7 == 0 else ({"pooling": "bogus"} if i % 11 == 0 else {})
                if i % 9 == 0:
                    images[0] = rng.choice(bad)
                payloads.append(multipart_request(port, images, fields=fields))
            rss = {"start": rss_mib(proc.pid)}
            statuses: dict[int, int] = {}
            done = 0
            for target in (first, total):
                while done < target:
                    clients = 8
                    per_client = max(1, min(500, target - done) // clients)
                    records, _ = count_requests(port, payloads, clients, per_client, done)
                    for r in records:
                        statuses[r.status] = statuses.get(r.status, 0) + 1
                    done += len(records)
                rss[str(target)] = rss_mib(proc.pid)
                print(f"  memory: RSS after {done} requests {rss[str(target)]:.1f} MiB", flush=True)
    growth = rss[str(total)] / rss[str(first)] - 1
    return {"requests": total, "first": first, "rss_mib": rss, "growth": growth, "statuses": statuses}


def _tests_conftest() -> Any:
    """``tests/conftest.py`` as a module (``tests`` is no package), without touching ``sys.path``."""
    spec = importlib.util.spec_from_file_location("vitembed_tests_conftest", ROOT / "tests" / "conftest.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {ROOT / 'tests' / 'conftest.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
