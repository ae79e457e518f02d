"""The Ray Serve deployment on a real local Ray cluster (2 CPUs, no dashboard), one Serve app for the module:
2 replicas of the tiny random-init DINOv2 behind Serve's HTTP proxy on 127.0.0.1. ``/v1/embed`` equals the
library, error bodies equal ``vitembed serve``'s, concurrent requests are served by both replicas (the
``X-Vitembed-Replica`` header), and after one replica's process gets SIGKILL only requests in flight on it
fail, each as a typed 503 (``replica_unavailable``), while the deployment keeps answering. Under a flood,
only Serve refuses (429, its backpressure) and the replica serves every request it was handed.

Skipped when ray[serve] is not installed (``pip install 'vitembed[ray]'``)."""

from __future__ import annotations

import io
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from vit_backbone import Backbone, load_backbone
from vit_backbone.decode import decode
from vit_backbone.errors import ImageDecodeError

serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install 'vitembed[ray]'")
import ray  # noqa: E402  (after the skip)
from vitembed.engine.admission import AdmissionControl  # noqa: E402
from vitembed.ray_serve import REPLICA_HEADER, deployment, replica_settings  # noqa: E402
from vitembed_client import Client, RetryPolicy, ServiceUnavailableError  # noqa: E402
from vitembed_client.errors import from_response  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
TOL = 1e-5
MAX_ONGOING = 2  # per replica: 8 concurrent requests cannot all fit on one
PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


@dataclass(frozen=True)
class ServeApp:
    url: str

    def replica_pids(self) -> dict[str, int]:
        """Live replica id -> process id, from the cluster's actor table."""
        from ray._private import state

        return {
            str(actor["Name"]).rsplit("#", 1)[1]: int(actor["Pid"])
            for actor in state.actors().values()
            if str(actor.get("Name", "")).startswith("SERVE_REPLICA::") and actor.get("State") == "ALIVE"
        }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def start_ray() -> None:
    """A local cluster; started a second time if the first start timed out (Ray waits a fixed 30 s for its
    raylet, which a machine busy with other work can miss)."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")  # the raylet waits for its agents
    for attempt in range(2):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception as exc:
            ray.shutdown()
            if attempt or "timed out during startup" not in str(exc):
                raise


@pytest.fixture(scope="module")
def tiny_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["dinov2"]


@pytest.fixture(scope="module")
def reference(tiny_path: Path) -> Backbone:
    return load_backbone(tiny_path)


@pytest.fixture(scope="module")
def app(tiny_path: Path) -> Iterator[ServeApp]:
    previous = os.environ.get(PROXY_CALLBACK)
    os.environ[PROXY_CALLBACK] = "vitembed.ray_serve:proxy_middlewares"  # the cluster's processes inherit it
    port = _free_port()
    start_ray()
    try:
        serve.start(http_options={"host": HOST, "port": port})
        settings = {
            "models": {"tiny": str(tiny_path)},
            "precision": "float32",
            "torch_threads": 1,
            "max_wait_ms": 2,
            "decode_workers": 1,
        }
        options = {
            "num_replicas": 2,
            "max_ongoing_requests": MAX_ONGOING,
            "ray_actor_options": {"num_cpus": 0.5},
        }
        serve.run(deployment().options(**options).bind(settings), name="vitembed", route_prefix="/")
        yield ServeApp(f"http://{HOST}:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
        if previous is None:
            os.environ.pop(PROXY_CALLBACK, None)
        else:
            os.environ[PROXY_CALLBACK] = previous


@pytest.fixture(scope="module")
def photos(sample_images: list[Any]) -> list[bytes]:
    out = []
    for size in ((64, 48), (80, 96), (57, 101)):
        for image in sample_images:
            buffer = io.BytesIO()
            image.resize(size).save(buffer, format="JPEG", quality=90)
            out.append(buffer.getvalue())
    return out


def test_replicas_answer_like_the_library_and_like_vitembed_serve(
    app: ServeApp, reference: Backbone, photos: list[bytes]
) -> None:
    with Client(app.url) as client:
        got = client.embed(photos[:6], normalize=True)
    np.testing.assert_allclose(got, reference.embed(photos[:6], normalize=True), atol=TOL, rtol=0)
    with httpx.Client(base_url=app.url, trust_env=False, timeout=30) as http:
        ok = http.post("/v1/embed", files=[("image", photos[0])])
        broken = http.post("/v1/embed", files=[("image", photos[0]), ("image", photos[1][:200])])
        models = http.get("/v1/models")
    assert ok.status_code == 200 and ok.headers[REPLICA_HEADER] in app.replica_pids()
    np.testing.assert_allclose(
        np.asarray([ok.json()["data"][0]["embedding"]]), reference.embed(photos[:1]), atol=TOL, rtol=0
    )
    with pytest.raises(ImageDecodeError) as library:
        decode(photos[1][:200])
    assert broken.status_code == 400 and broken.headers["content-type"] == "application/json"
    assert broken.json() == {
        "error": {
            "code": "truncated",
            "message": str(library.value),
            "index": 1,
            "request_id": broken.headers["x-request-id"],
        }
    }
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]


def test_concurrent_requests_are_served_by_both_replicas(app: ServeApp, photos: list[bytes]) -> None:
    count = 4 * MAX_ONGOING  # more than one replica may hold at once
    barrier = threading.Barrier(count)
    limits = httpx.Limits(max_connections=count)

    def post(http: httpx.Client) -> str:
        barrier.wait(30)
        response = http.post("/v1/embed", files=[("image", photos[0])] * 4)
        assert response.status_code == 200, response.text
        return response.headers[REPLICA_HEADER]

    with (
        httpx.Client(base_url=app.url, trust_env=False, timeout=30, limits=limits) as http,
        ThreadPoolExecutor(count) as pool,
    ):
        replicas = set(pool.map(post, [http] * count))
    assert replicas == set(app.replica_pids())
    assert len(replicas) == 2


def test_after_sigkill_of_a_replica_only_its_in_flight_requests_fail_as_typed_503s(
    app: ServeApp, reference: Backbone, photos: list[bytes]
) -> None:
    pids = app.replica_pids()
    assert len(pids) == 2
    victim, survivor = sorted(pids)
    expected = reference.embed(photos[:3])
    stop = threading.Event()
    seen_victim = threading.Event()
    killed_at: list[float] = []
    outcomes: list[tuple[float, float, Any]] = []  # (sent, answered, replica id or the error)
    lock = threading.Lock()

    def load() -> None:
        with httpx.Client(base_url=app.url, trust_env=False, timeout=30) as http:
            while not stop.is_set():
                sent = time.monotonic()
                response = http.post("/v1/embed", files=[("image", p) for p in photos[:3]])
                result: Any = from_response(response) if response.status_code != 200 else None
                if result is None:
                    vectors = np.asarray([item["embedding"] for item in response.json()["data"]])
                    np.testing.assert_allclose(vectors, expected, atol=TOL, rtol=0)
                    result = response.headers[REPLICA_HEADER]
                    if result == victim:
                        seen_victim.set()
                with lock:
                    outcomes.append((sent, time.monotonic(), result))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        assert seen_victim.wait(30), "no request reached the victim replica"
        killed_at.append(time.monotonic())
        os.kill(pids[victim], signal.SIGKILL)
        # the deployment keeps answering: a retrying client gets its answer
        with Client(app.url, retry=RetryPolicy(deadline=30.0)) as client:
            np.testing.assert_allclose(client.embed(photos[:3]), expected, atol=TOL, rtol=0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # 20 answers after the kill, from the survivor
            with lock:
                after = [o for o in outcomes if o[0] > killed_at[0] and o[2] == survivor]
            if len(after) >= 20:
                break
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    kill = killed_at[0]
    failures = [(sent, error) for sent, _answered, error in outcomes if not isinstance(error, str)]
    assert len([o for o in outcomes if o[0] > kill and o[2] == survivor]) >= 20
    # only requests in flight at the kill (one per loader thread at most) may fail, and only as typed 503s
    assert len(failures) <= len(threads), failures
    for sent, error in failures:
        assert isinstance(error, ServiceUnavailableError), repr(error)
        assert (error.status, error.code) == (503, "replica_unavailable")
        assert error.request_id and error.retry_after == 1.0
        assert sent < kill + 5.0  # sent before the router knew of the death, not long after


def test_under_a_flood_only_serve_refuses_and_every_admitted_request_is_served(
    app: ServeApp, tiny_path: Path, reference: Backbone, photos: list[bytes]
) -> None:
    """A second app on the same cluster, one replica taking 1 ongoing request and Serve's queue 2 more, under
    24 concurrent 8-image requests, three times: the refusals are Serve's 429 (its backpressure text, its
    ``Retry-After``, no replica header), every request that reached the replica is a 200 with the library's
    vectors, and the replica's own admission refused nothing (its ``/metrics``)."""
    settings = {"models": {"tiny": str(tiny_path)}, "precision": "float32", "torch_threads": 1}
    options = {
        "num_replicas": 1,
        "max_ongoing_requests": 1,
        "max_queued_requests": 2,
        "ray_actor_options": {"num_cpus": 0.5},
    }
    serve.run(deployment().options(**options).bind(settings), name="flood", route_prefix="/flood")
    try:
        batch = [("image", p) for p in photos[:8]]
        expected = reference.embed(photos[:8])
        count = 24
        limits = httpx.Limits(max_connections=count)
        with (
            httpx.Client(base_url=f"{app.url}/flood", trust_env=False, timeout=60, limits=limits) as http,
            ThreadPoolExecutor(count) as pool,
        ):

            def post(barrier: threading.Barrier) -> httpx.Response:
                barrier.wait(30)
                return http.post("/v1/embed", files=batch)

            answers: list[httpx.Response] = []
            for _ in range(3):
                answers += list(pool.map(post, [threading.Barrier(count)] * count))
            metrics = http.get("/metrics").text
        served = [r for r in answers if REPLICA_HEADER in r.headers]
        refused = [r for r in answers if r.status_code == 429]
        assert len(served) + len(refused) == len(answers), [(r.status_code, r.text[:200]) for r in answers]
        assert refused and len(served) >= 3, (len(served), len(refused))
        for response in served:
            assert response.status_code == 200, response.text
            vectors = np.asarray([item["embedding"] for item in response.json()["data"]])
            np.testing.assert_allclose(vectors, expected, atol=TOL, rtol=0)
        for response in refused:
            assert REPLICA_HEADER not in response.headers
            assert response.text.startswith("Request dropped due to backpressure"), response.text
            assert response.headers["retry-after"] == "1"
        admission = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vitembed_admission_total{")
        }
        assert admission['vitembed_admission_total{model="tiny",outcome="admitted"}'] == len(served)
        assert sum(v for k, v in admission.items() if 'outcome="admitted"' not in k) == 0, admission
    finally:
        serve.delete("flood")


def test_replica_settings_make_the_replica_admit_what_serve_hands_it() -> None:
    settings = replica_settings(
        {"max_images_per_request": 64, "request_timeout_s": 20}, max_ongoing_requests=8
    )
    assert (settings.queue_size, settings.queue_delay_target_s) == (9 * 64 - 1, 20.0)
    control = AdmissionControl(settings.queue_size, settings.queue_delay_target_s)
    load = control.model("m")
    for _ in range(8):  # Serve's eight ongoing requests of 64 images all fit beside the fairness rule
        load.admit(64, 256, deadline_left_s=20.0)
    assert control.held == 8 * 64
    with pytest.raises(ValueError, match="set queue_size >= 143"):
        replica_settings({"max_images_per_request": 16, "queue_size": 64}, max_ongoing_requests=8)
    with pytest.raises(ValueError, match="set max_concurrent_requests >= 8"):
        replica_settings({"max_concurrent_requests": 4}, max_ongoing_requests=8)
    with pytest.raises(ValueError, match="drop queue_delay_target_s"):
        replica_settings({"queue_delay_target_s": 1.0, "request_timeout_s": 30}, max_ongoing_requests=8)


def test_serve_config_is_valid_and_builds_the_app() -> None:
    """deploy/ray/serve_config.yaml passes Serve's own schema, and its import path builds the application."""
    import importlib

    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(
        yaml.safe_load((ROOT / "deploy/ray/serve_config.yaml").read_text())
    )
    (application,) = config.applications
    (options,) = application.deployments
    assert options.max_queued_requests > 0 and options.backpressure_config.status_code == 429
    assert options.autoscaling_config["max_replicas"] > options.autoscaling_config["min_replicas"]
    assert options.ray_actor_options.num_gpus == 1
    module, _, name = application.import_path.partition(":")
    built = getattr(importlib.import_module(module), name)(application.args)
    assert type(built).__name__ == "Application"
    with pytest.raises(ValueError, match="put ServiceSettings fields under 'settings'"):
        getattr(importlib.import_module(module), name)({"models": {"a": "embedded"}})
