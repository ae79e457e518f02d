"""Against a real ``vitembed serve`` process on 127.0.0.1, started by the test: the numbers equal the
library's, concurrent requests share forward passes, broken JPEGs get 400 and leave the server healthy, a
flood past the queue gets 429s and no 5xx, a disconnected client's queued work is dropped, SIGTERM drains
in-flight requests and exits 0, and an invalid setting stops start-up with one line and status 2.

Every server listens on loopback only and is stopped in a finaliser (SIGTERM, then SIGKILL after a
timeout); its log goes to a temp file that is printed when a test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import openai
import pytest
from promtext import sum_samples

from vit_backbone import Backbone
from vit_backbone.decode import decode
from vit_backbone.errors import ImageDecodeError

if TYPE_CHECKING:  # fixtures' types (tests/service/conftest.py)
    from conftest import Images

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"  # loopback only, always
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0  # the server's graceful-shutdown timeout
TOL = 1e-5
DIM = 32  # the tiny DINOv2's width

# The "slow" server: a queue that holds fewer images than one batch, so every admitted image waits the full
# batch timer before its forward pass. That makes "the queue is full" and "this request is still queued"
# states that last SLOW_WAIT_S, not races against a millisecond forward pass of the tiny model.
SLOW_WAIT_S = 1.5
SLOW_FLAGS = (
    "--queue-size", "4",
    "--max-images-per-request", "4",
    "--max-batch-size", "8",
    "--max-wait-ms", str(int(SLOW_WAIT_S * 1000)),
)  # fmt: skip


# ------------------------------------------------------------------------------------------- the process
@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    _log_file: Any = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self, start: int = 0) -> str:
        with self.log_path.open("rb") as f:
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def client(self, timeout: float = 30.0, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, trust_env=False, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        with self.client() as client:
            return sum_samples(client.get("/metrics").text, name, **labels)

    def terminate(self) -> None:
        """SIGTERM, without waiting (servers then shut down side by side); ``stop`` waits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it has not exited within the graceful timeout; returns the status."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
        return self.proc.returncode


_SERVERS: list[ServerProcess] = []  # every server this module started, for the logs of a failed test


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def server_env(**extra: str) -> dict[str, str]:
    """This environment without any VITEMBED_* setting of the caller's, offline, unbuffered logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITEMBED_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", VITEMBED_TORCH_THREADS="1", **extra)
    return env


def serve_command(model: Path, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "vitembed", "serve",
        "--model", f"tiny={model}",
        "--host", HOST,
        "--port", str(port),
        "--precision", "float32",  # comparable with the library to 1e-5
        *flags,
    ]  # fmt: skip


def start_server(model: Path, log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``vitembed serve`` and return once ``GET /ready`` answers 200 (at most READY_TIMEOUT_S); ``env``
    adds variables (e.g. ``VITEMBED_API_KEY``, which has no flag) to ``server_env()``."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    log_file = log_path.open("wb")
    proc = subprocess.Popen(
        serve_command(model, port, *flags),
        cwd=ROOT,
        env=server_env(**(env or {})),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    server = ServerProcess(proc, port, log_path, log_file)
    _SERVERS.append(server)
    try:
        wait_until_ready(server)
    except BaseException:
        server.stop()
        raise
    return server


def wait_until_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with server.client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                pytest.fail(
                    f"vitembed serve exited with {server.proc.returncode} before ready:\n{server.log()}"
                )
            try:
                if client.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.1)
    pytest.fail(f"vitembed serve not ready within {READY_TIMEOUT_S:g} s:\n{server.log()}")


@pytest.fixture(scope="module", autouse=True)
def _stop_every_server() -> Iterator[None]:
    """No server outlives this module, whatever a test did: each is terminated, then killed on timeout."""
    yield
    for server in _SERVERS:
        server.terminate()
    for server in _SERVERS:
        server.stop()


@pytest.fixture(autouse=True)
def _print_server_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """When a test fails, every server's log is printed (pytest shows it with the failure), with a mark where
    the test began."""
    failed_before = request.session.testsfailed
    offsets = {id(server): server.log_size() for server in _SERVERS}
    yield
    if request.session.testsfailed > failed_before:
        for server in _SERVERS:
            raw, start = server.log_path.read_bytes(), offsets.get(id(server), 0)
            proc = server.proc
            print(f"\n===== vitembed serve, port {server.port}, pid {proc.pid}, exit {proc.poll()}")
            print(raw[:start].decode("utf-8", "replace"), end="")
            print(f"----- {request.node.name} begins -----")
            print(raw[start:].decode("utf-8", "replace"), end="")


@pytest.fixture(scope="module")
def server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Default limits; a batch waits up to 50 ms to fill, so concurrent requests meet in one."""
    started = start_server(tiny_path, tmp_path_factory.mktemp("serve"), "--max-wait-ms", "50")
    yield started
    started.terminate()  # waited for (and killed if need be) by _stop_every_server


@pytest.fixture(scope="module")
def slow_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = start_server(tiny_path, tmp_path_factory.mktemp("serve-slow"), *SLOW_FLAGS)
    yield started
    started.terminate()  # waited for (and killed if need be) by _stop_every_server


# ------------------------------------------------------------------------------------------- helpers
def floats(body: dict[str, Any]) -> np.ndarray:
    return np.asarray([item["embedding"] for item in body["data"]], dtype=np.float64)


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The error object without its request id, after checking that the id matches the header."""
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"], body
    error = dict(body["error"])
    assert error.pop("request_id") == response.headers["x-request-id"]
    return error


def library_message(data: bytes) -> str:
    with pytest.raises(ImageDecodeError) as caught:
        decode(data)
    return str(caught.value)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def post_all(server: ServerProcess, bodies: list[list[bytes]], timeout: float = 30.0) -> list[httpx.Response]:
    """Post every request at the same moment, one thread and connection each; responses in order."""
    barrier = threading.Barrier(len(bodies))
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    with server.client(limits=limits, timeout=timeout) as client, ThreadPoolExecutor(len(bodies)) as pool:

        def post(images: list[bytes]) -> httpx.Response:
            barrier.wait(timeout)
            return client.post("/v1/embed", files=[("image", data) for data in images])

        return list(pool.map(post, bodies))


def raw_request(port: int, path: str, request: httpx.Request) -> bytes:
    """The bytes of ``request`` as HTTP/1.1 on the wire, for a client that hangs up on its own terms."""
    body = request.read()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: {request.headers['content-type']}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


# ------------------------------------------------------------------------------------------- tests
def test_embeddings_equal_the_library_over_multipart_and_the_openai_client(
    server: ServerProcess, reference: Backbone, images: Images
) -> None:
    batch = [images.jpeg(90, 70, 0), images.jpeg(120, 64, 2), images.jpeg(64, 96, 4)]
    with server.client() as client:
        response = client.post("/v1/embed", files=[("image", data) for data in batch])
        assert response.status_code == 200, response.text
        body = response.json()
        assert (body["model"], body["dim"]) == ("tiny", DIM)
        assert [item["index"] for item in body["data"]] == [0, 1, 2]
        assert body["provenance"]["dtype"] == "float32" and body["provenance"]["precision"] == "float32"
        np.testing.assert_allclose(floats(body), reference.embed(batch), atol=TOL, rtol=0)

        form = {
            "pooling": "mean",
            "layers": "-2,-1",
            "normalize": "true",
            "size": "112,84",
            "policy": "squash",
        }
        response = client.post("/v1/embed", files=[("image", data) for data in batch], data=form)
        assert response.status_code == 200, response.text
        expected = reference.embed(
            batch, pooling="mean", layers=[-2, -1], normalize=True, size=(112, 84), policy="squash"
        )
        assert response.json()["dim"] == 2 * DIM
        np.testing.assert_allclose(floats(response.json()), expected, atol=TOL, rtol=0)

    uris = [images.data_uri(data) for data in batch]
    http_client = openai.DefaultHttpxClient(trust_env=False, timeout=30.0)  # no proxy for loopback
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="x", max_retries=0, http_client=http_client
    ) as oai:
        created = oai.embeddings.create(model="tiny", input=uris)  # the client asks for base64 by default
        assert created.model == "tiny" and [d.index for d in created.data] == [0, 1, 2]
        got = np.asarray([d.embedding for d in created.data], dtype=np.float64)
        np.testing.assert_allclose(got, reference.embed(batch, normalize=True), atol=TOL, rtol=0)  # unit
        one = oai.embeddings.create(model="tiny", input=uris[1], encoding_format="float")
        np.testing.assert_allclose(
            np.asarray(one.data[0].embedding), reference.embed(batch[1:2], normalize=True)[0], atol=TOL
        )
        assert [m.id for m in oai.models.list().data] == ["tiny"]


def test_start_up_log_has_no_progress_bars(server: ServerProcess) -> None:
    log = server.log()
    assert "model tiny ready in" in log
    assert "Loading weights" not in log and "it/s]" not in log  # transformers' tqdm bars stay off


def test_32_concurrent_single_image_requests_share_forward_passes(
    server: ServerProcess, reference: Backbone, images: Images
) -> None:
    singles = [images.jpeg(64 + i, 64, 100 + i) for i in range(32)]
    passes_before = server.metric("vitembed_forward_passes_total", model="tiny")
    images_before = server.metric("vitembed_images_total", model="tiny")
    responses = post_all(server, [[data] for data in singles])
    assert [r.status_code for r in responses] == [200] * 32, [r.text for r in responses]
    passes = server.metric("vitembed_forward_passes_total", model="tiny") - passes_before
    assert server.metric("vitembed_images_total", model="tiny") - images_before == 32
    assert 1 <= passes < 32, passes
    # batching mixed 32 requests in few passes: every answer is still its own image's embedding
    got = np.concatenate([floats(r.json()) for r in responses])
    np.testing.assert_allclose(got, reference.embed(singles), atol=TOL, rtol=0)


def test_truncated_jpegs_get_400_and_the_next_request_succeeds_at_once(
    server: ServerProcess, images: Images
) -> None:
    whole = images.jpeg(90, 70, 0)
    header_cut = whole[:20]
    half = whole[: len(whole) // 2]  # the header parses; decoding the pixels fails
    expected = {
        "header": "the data starts like a JPEG image but its header is truncated or corrupt",
        "half": library_message(half),
    }
    assert expected["half"].startswith("the JPEG image is truncated or corrupt and could not be decoded (")
    log_start = server.log_size()
    with server.client() as client:
        for case, data in (("header", header_cut), ("half", half)):
            response = client.post("/v1/embed", files={"image": data})
            assert response.status_code == 400, response.text
            assert error_of(response) == {"code": "truncated", "message": expected[case], "index": 0}
            started = time.monotonic()
            good = client.post("/v1/embed", files={"image": images.jpeg(64, 64, 9)})
            assert good.status_code == 200, good.text
            assert time.monotonic() - started < 2.0
            assert client.get("/ready").status_code == 200
    assert "Traceback" not in server.log(log_start)


def test_a_flood_past_the_queue_gets_429s_no_5xx_and_the_server_stays_ready(
    slow_server: ServerProcess, images: Images
) -> None:
    """40 requests of 4 images at once against a queue of 4: one is admitted and holds the whole queue
    while its batch waits, the rest are refused at once."""
    four = [images.jpeg(64, 64, seed) for seed in range(4)]
    rejected_before = slow_server.metric("vitembed_rejected_total", reason="queue_full")
    counted_before = slow_server.metric("vitembed_requests_total", route="/v1/embed", status="429")
    started = time.monotonic()
    responses = post_all(slow_server, [four] * 40)
    assert time.monotonic() - started < 20.0
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    assert refused and statuses.count(200) >= 1, statuses
    for response in refused:
        retry_after = response.headers["retry-after"]
        assert retry_after.isdigit() and int(retry_after) >= 1
        assert error_of(response) == {
            "code": "queue_full",
            "message": f"the server is at capacity; retry in {retry_after} s",
        }
    for response in responses:
        if response.status_code == 200:
            assert len(response.json()["data"]) == 4
    rejected = slow_server.metric("vitembed_rejected_total", reason="queue_full") - rejected_before
    counted = slow_server.metric("vitembed_requests_total", route="/v1/embed", status="429") - counted_before
    assert rejected == counted == len(refused)
    with slow_server.client() as client:
        assert client.get("/ready").status_code == 200
        assert client.post("/v1/embed", files={"image": four[0]}).status_code == 200


def hang_up_while_queued(server: ServerProcess, wire: bytes) -> tuple[float, float]:
    """Send ``wire`` whole, wait until its image is queued, hang up, and wait until the item is gone from
    the queue: returns (items dropped as cancelled, forward passes run) meanwhile."""

    def deltas() -> tuple[float, float]:
        return (
            server.metric("vitembed_rejected_total", reason="cancelled") - cancelled_before,
            server.metric("vitembed_forward_passes_total", model="tiny") - passes_before,
        )

    def depth() -> float:
        return server.metric("vitembed_queue_depth", model="tiny")

    passes_before = server.metric("vitembed_forward_passes_total", model="tiny")
    cancelled_before = server.metric("vitembed_rejected_total", reason="cancelled")
    with socket.create_connection((HOST, server.port), timeout=10) as sock:
        sock.sendall(wire)
        wait_for(lambda: depth() == 1, 10.0, "the image to be queued")
    # closed: the server sees the hang-up, cancels the request, and the batcher drops the item
    wait_for(lambda: sum(deltas()) >= 1 and depth() == 0, 10.0, "the queued item to be dropped or run")
    return deltas()


def test_a_disconnected_clients_queued_work_is_dropped(slow_server: ServerProcess, images: Images) -> None:
    """A raw client sends a whole request, waits until its image is queued (its batch waits SLOW_WAIT_S to
    fill), then hangs up: the item is dropped, no forward pass runs for it, the app counts a 499. Should the
    machine stall past the batch timer before the hang-up is seen, the attempt is repeated (at most 3)."""
    request = httpx.Request("POST", f"{slow_server.url}/v1/embed", files={"image": images.jpeg(80, 60, 7)})
    wire = raw_request(slow_server.port, "/v1/embed", request)

    def closed() -> float:
        return slow_server.metric("vitembed_requests_total", route="/v1/embed", status="499")

    attempts: list[tuple[float, float]] = []
    closed_before = closed()
    for _ in range(3):
        attempts.append(hang_up_while_queued(slow_server, wire))
        if attempts[-1] == (1, 0):
            break
    assert attempts[-1] == (1, 0), f"(dropped, forward passes) per attempt: {attempts}"
    wait_for(lambda: closed() - closed_before == len(attempts), 5.0, "a 499 counted per hang-up")

    passes_before = slow_server.metric("vitembed_forward_passes_total", model="tiny")
    with slow_server.client() as client:
        assert client.post("/v1/embed", files={"image": images.jpeg()}).status_code == 200
    assert slow_server.metric("vitembed_forward_passes_total", model="tiny") - passes_before == 1


def test_sigterm_finishes_in_flight_requests_then_exits_0(
    tiny_path: Path, tmp_path: Path, reference: Backbone, images: Images
) -> None:
    server = start_server(tiny_path, tmp_path, "--max-wait-ms", "2000", "--max-batch-size", "8")
    try:
        batch = [images.jpeg(70 + i, 64, 200 + i) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            in_flight = [pool.submit(post_all, server, [[data]]) for data in batch]
            wait_for(
                lambda: server.metric("vitembed_queue_depth", model="tiny") == 4, 10.0, "4 requests queued"
            )
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()

            # it stops accepting while the 4 requests still wait for their batch (2 s after they queued)
            def refused() -> bool:
                try:
                    socket.create_connection((HOST, server.port), timeout=1).close()
                except ConnectionRefusedError:
                    return True
                return False

            wait_for(refused, 5.0, "new connections to be refused")
            assert server.proc.poll() is None and not any(f.done() for f in in_flight)
            responses = [future.result(timeout=30)[0] for future in in_flight]  # no reset, no error
        assert [r.status_code for r in responses] == [200] * 4
        got = np.concatenate([floats(r.json()) for r in responses])
        np.testing.assert_allclose(got, reference.embed(batch), atol=TOL, rtol=0)
        assert server.proc.wait(STOP_TIMEOUT_S) == 0
        assert time.monotonic() - signalled < STOP_TIMEOUT_S
    finally:
        server.stop()
    log = server.log()
    assert "Application shutdown complete." in log and "Finished server process" in log
    assert "Traceback" not in log


def test_an_invalid_setting_exits_2_with_one_line_and_no_traceback(tiny_path: Path) -> None:
    cases = [
        (
            ["--max-batch-size", "0"],
            {},
            "vitembed serve: error: invalid setting max_batch_size: "
            "Input should be greater than or equal to 1",
        ),
        (
            [],
            {"VITEMBED_QUEUE_SIZE": "abc"},
            "vitembed serve: error: invalid setting queue_size: "
            "Input should be a valid integer, unable to parse string as an integer",
        ),
    ]
    procs = [  # side by side; settings are validated before the service's heavy imports
        subprocess.Popen(
            serve_command(tiny_path, free_port(), *flags),
            cwd=ROOT,
            env=server_env(**env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for flags, env, _ in cases
    ]
    try:
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for proc, (stdout, stderr), (_, _, message) in zip(procs, outputs, cases, strict=True):
        assert proc.returncode == 2, stderr.decode()
        assert stderr.decode() == message + "\n"
        assert stdout == b""
