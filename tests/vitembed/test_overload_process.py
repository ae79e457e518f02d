"""Overload against a real ``vitembed serve`` process on 127.0.0.1: a flood far above capacity is answered
with 429s carrying ``Retry-After`` while every admitted request finishes before its deadline (no 504, no
5xx), and a client's shorter deadline (``X-Request-Timeout``) is honoured.

The model is the tiny DINOv2 asked for 896x896 inputs (4096 patch tokens, ~0.1 s per image on one
thread), so that a few dozen client threads are far above its capacity. Margins are wide: this VM's speed
drifts by tens of percent and other processes share its cores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_server_process import ServerProcess, error_of, start_server, wait_for

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images

TIMEOUT_S = 10.0  # the server's request deadline
TARGET_S = 1.0  # its queue-delay target
FLOOD_S = 4.0
CLIENTS = 32
BIG = {"size": "896,896", "policy": "squash"}  # 64 x 64 = 4096 patch tokens per image


@dataclass(frozen=True)
class Answer:
    status: int
    seconds: float
    retry_after: str | None
    code: str | None


@pytest.fixture(scope="module")
def flood_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(
        tiny_path,
        tmp_path_factory.mktemp("serve-overload"),
        "--queue-delay-target-s", str(TARGET_S),
        "--request-timeout-s", str(TIMEOUT_S),
        "--max-wait-ms", "5",
    )  # fmt: skip
    yield server
    server.stop()


def flood(server: ServerProcess, data: bytes, clients: int, seconds: float) -> list[Answer]:
    """``clients`` threads, one connection each, posting back to back (Retry-After ignored)."""
    answers: list[Answer] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    start = threading.Barrier(clients)

    def client() -> None:
        with server.client(timeout=TIMEOUT_S + 20) as http:
            start.wait(30)
            while time.monotonic() < stop_at:
                began = time.monotonic()
                response = http.post("/v1/embed", files={"image": data}, data=BIG)
                code = error_of(response)["code"] if response.status_code != 200 else None
                answer = Answer(
                    response.status_code, time.monotonic() - began, response.headers.get("retry-after"), code
                )
                with lock:
                    answers.append(answer)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + TIMEOUT_S + 30)
    return answers


def test_a_flood_far_above_capacity_gets_429s_and_admitted_requests_finish_in_time(
    flood_server: ServerProcess, images: Images
) -> None:
    data = images.jpeg(64, 64, 7)

    def refusals(stage: str) -> float:
        return sum(
            flood_server.metric("vitembed_rejected_total", reason=reason, stage=stage)
            for reason in ("queue_delay", "queue_full", "deadline")
        )

    before = {stage: refusals(stage) for stage in ("head", "body")}
    answers = flood(flood_server, data, CLIENTS, FLOOD_S)
    statuses = sorted({a.status for a in answers})
    assert set(statuses) <= {200, 429}, statuses  # no 504, no 5xx
    ok = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    # a flood, refused rather than queued: 32 clients are more than the 1 s target admits at once. Not a
    # ratio of refusals to 200s: the server holds a refused client's next request until its Retry-After
    # (1 s or more), so the refusals are bounded by clients x flood / hold, not by the offered load, while
    # the 200s follow the VM's speed (a clean-clone CI run on a fast host: 84 of each)
    assert ok and len(refused) >= CLIENTS // 2, (len(ok), len(refused))
    for answer in refused:
        assert answer.retry_after is not None and answer.retry_after.isdigit(), answer
        assert int(answer.retry_after) >= 1
        assert answer.code in {"overloaded", "queue_full"}, answer
    # every admitted request finished well before its deadline (expected: about the target + one batch)
    assert max(a.seconds for a in ok) < TIMEOUT_S, sorted(a.seconds for a in ok)[-5:]
    admitted = flood_server.metric("vitembed_admission_total", outcome="admitted")
    assert admitted >= len(ok)
    assert flood_server.metric("vitembed_rejected_total", reason="deadline") == 0
    # every 429 was counted once, by where it was decided. How many fall on the head is timing: the head
    # check prices one image at the model's default grid (1/16 of these 896x896 ones), so it refuses only
    # while the queue is within one small image of the target (a clean-clone CI run had 0 of 83 there);
    # test_early_refusal.py checks the head's refusal on a real engine, test_retry_after_hold.py the protocol
    # writing it
    on_head, after_body = (refusals(stage) - before[stage] for stage in ("head", "body"))
    assert on_head + after_body == len(refused), (on_head, after_body, len(refused))
    with flood_server.client() as client:  # and it is at once available again
        assert client.get("/ready").status_code == 200
        began = time.monotonic()
        after = client.post("/v1/embed", files={"image": data}, data=BIG)
        assert after.status_code == 200, after.text
        assert time.monotonic() - began < TIMEOUT_S / 2


def test_a_client_deadline_shorter_than_the_batch_timer_is_honoured(
    tiny_path: Path, tmp_path_factory: pytest.TempPathFactory, images: Images
) -> None:
    """A batch waits 3 s to fill; a request allowing 0.5 s is answered 504 after about 0.5 s and its
    queued image never reaches a forward pass."""
    server = start_server(tiny_path, tmp_path_factory.mktemp("serve-deadline"), "--max-wait-ms", "3000")
    try:
        passes_before = server.metric("vitembed_forward_passes_total", model="tiny")
        with server.client() as client:
            began = time.monotonic()
            response = client.post(
                "/v1/embed", files={"image": images.jpeg()}, headers={"X-Request-Timeout": "0.5"}
            )
            took = time.monotonic() - began
        assert response.status_code == 504, response.text
        assert error_of(response) == {"code": "deadline_exceeded", "message": "no result within 0.5 s"}
        assert 0.45 < took < 2.5, took  # not the 3 s timer, nor the server's 30 s deadline
        # when the batch timer fires, the abandoned image is dropped instead of forwarded
        wait_for(lambda: server.metric("vitembed_rejected_total", reason="cancelled") == 1, 15, "the drop")
        assert server.metric("vitembed_forward_passes_total", model="tiny") == passes_before
        with server.client() as client:
            assert client.post("/v1/embed", files={"image": images.jpeg()}).status_code == 200
    finally:
        server.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_no_gross_leak_over_thousands_of_mixed_requests(
    tiny_path: Path, tmp_path_factory: pytest.TempPathFactory, images: Images
) -> None:
    """RSS after 2,000 mixed requests (1-8 images of several sizes, some invalid) stays within 15 % of RSS
    after the first 300 (the bench measures 10,000 vs 1,000 to 5 %)."""
    server = start_server(tiny_path, tmp_path_factory.mktemp("serve-leak"))
    good = [images.jpeg(w, h, seed) for seed, (w, h) in enumerate([(64, 64), (160, 120), (320, 240)])]
    bodies: list[tuple[list[bytes], dict[str, str]]] = []
    for i in range(40):
        count = (1, 1, 2, 4, 8)[i % 5]
        batch = [good[(i + k) % len(good)] for k in range(count)]
        if i % 9 == 0:
            batch[0] = good[0][: len(good[0]) // 2]  # truncated: 400
        form = {"pooling": "patch"} if i % 7 == 0 else ({"pooling": "bogus"} if i % 11 == 0 else {})
        bodies.append((batch, form))

    def send(count: int, offset: int) -> dict[int, int]:
        statuses: dict[int, int] = {}
        lock = threading.Lock()

        def client(worker: int) -> None:
            with server.client() as http:
                for k in range(worker, count, 8):
                    batch, form = bodies[(offset + k) % len(bodies)]
                    response = http.post("/v1/embed", files=[("image", d) for d in batch], data=form)
                    with lock:
                        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        return statuses

    try:
        first = send(300, 0)
        after_first = rss_mib(server.proc.pid)
        rest = send(1700, 300)
        after_all = rss_mib(server.proc.pid)
        statuses = {code: first.get(code, 0) + rest.get(code, 0) for code in {*first, *rest}}
        assert sum(statuses.values()) == 2000 and set(statuses) <= {200, 400, 422, 429}, statuses
        assert statuses.get(400, 0) > 0 and statuses.get(422, 0) > 0 and statuses[200] > 1000, statuses
        assert after_all < after_first * 1.15, (after_first, after_all)
    finally:
        server.stop()
