"""Thread priorities of a serving process: ``vitembed serve`` runs its event-loop thread at a lower nice
value where the process may (CAP_SYS_NICE or RLIMIT_NICE), and every worker thread (forward, decode,
engine start, asyncio's pool) at the process's own value, although a new thread starts at its creator's.
Without the permission the server keeps one priority for all threads and says so in its log."""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from test_server_process import start_server
from vitembed.engine import priority

if TYPE_CHECKING:  # fixtures' types (tests/vitembed/conftest.py)
    from conftest import Images


def may_raise_priority() -> bool:
    """Whether a thread of this process may take a nice value 5 below the process's, as the server's event
    loop does by default (tried on a thread of its own, which ends with the try)."""
    allowed: list[bool] = []

    def attempt() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(-20, os.getpriority(os.PRIO_PROCESS, tid) - 5))
            allowed.append(True)
        except OSError:
            allowed.append(False)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return allowed[0]


@pytest.fixture
def fresh_priority(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module's record of the process's nice value, as in a process that raised no thread."""
    monkeypatch.setattr(priority, "_process_nice", None)
    yield
    threading.setprofile(None)  # the hook a raise installs for threads started later


def run_on_thread(func: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            func()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    if errors:
        raise errors[0]


@pytest.mark.usefixtures("fresh_priority")
def test_a_raised_thread_creates_workers_that_go_back_to_the_process_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if not may_raise_priority():
        pytest.skip("this process may not lower a thread's nice value (no CAP_SYS_NICE, RLIMIT_NICE 0)")
    seen: dict[str, int] = {}

    def raised_thread() -> None:
        assert priority.raise_calling_thread(5)
        seen["raised"] = priority.thread_nice()
        started = threading.Event()

        def from_c() -> None:  # not started by the threading module: no hook, the inherited value
            seen["raw thread"] = priority.thread_nice()
            started.set()

        _thread.start_new_thread(from_c, ())
        assert started.wait(10)
        plain = threading.Thread(target=lambda: seen.setdefault("threading.Thread", priority.thread_nice()))
        plain.start()
        plain.join()
        with ThreadPoolExecutor(1) as pool:
            seen["worker"] = pool.submit(priority.thread_nice).result()

    run_on_thread(raised_thread)
    assert seen == {
        "raised": max(-20, base - 5),
        "raw thread": max(-20, base - 5),
        "threading.Thread": base,
        "worker": base,
    }
    assert priority._process_nice == base
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the test's own thread is untouched


@pytest.mark.usefixtures("fresh_priority")
def test_without_a_raise_workers_keep_their_priority_and_a_zero_step_does_nothing() -> None:
    seen: dict[str, int] = {}

    def plain_thread() -> None:
        assert not priority.raise_calling_thread(0)
        with ThreadPoolExecutor(1) as pool:
            seen["worker"] = pool.submit(priority.thread_nice).result()

    run_on_thread(plain_thread)
    assert seen == {"worker": os.getpriority(os.PRIO_PROCESS, 0)}
    assert priority._process_nice is None


def thread_nices(pid: int) -> dict[int, int]:
    """Thread id -> its nice value (``/proc/<pid>/task/*/stat``, field 19)."""
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc/<pid>/task (Linux)")
def test_serve_raises_its_event_loop_thread_and_no_other(
    tiny_path: Path, tmp_path: Path, images: Images
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the server inherits it
    permitted = may_raise_priority()
    server = start_server(tiny_path, tmp_path, "--decode-workers", "2")
    try:
        with server.client() as http:
            for k in range(4):  # the decode pool's threads start with the first requests
                assert http.post("/v1/embed", files={"image": images.jpeg(seed=k)}).status_code == 200
            # anyio's worker threads (Starlette's FileResponse), started by the event loop after the raise
            assert http.get("/explore").status_code == 200
            big = images.png(900, 900)  # over 1 MiB: parsed on asyncio's default pool
            assert len(big) > 1 << 20
            assert http.post("/v1/embed", files={"image": big}).status_code == 200
        nices = thread_nices(server.proc.pid)
        log = server.log()
    finally:
        server.stop()
    main = nices.pop(server.proc.pid)  # the event loop's thread (uvicorn runs it on the main thread)
    # forward threads (1 per CPU, at least 1), 2 decode workers, and what else the process runs (libuv's
    # pool, torch's): every one at the process's value
    assert len(nices) >= 3, nices
    assert set(nices.values()) == {base}, nices
    if permitted:
        assert main == max(-20, base - 5)
        assert f"event-loop thread at nice {max(-20, base - 5)} (the process's: {base})" in log
    else:
        assert main == base
        assert "event loop kept the process's priority" in log
