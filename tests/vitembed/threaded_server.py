"""A uvicorn server run on a thread of the test process (no signal handlers off the main thread): started,
handed to the test, told to exit and joined."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import uvicorn

ServerT = TypeVar("ServerT", bound=uvicorn.Server)


@contextmanager
def running_on_a_thread(server: ServerT, timeout_s: float = 30.0) -> Iterator[ServerT]:
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout_s)
