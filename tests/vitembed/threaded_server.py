"""A uvicorn server run on a thread of the test process (no signal handlers off the main thread): started,
handed to the test, told to exit and joined; and ``hello``, the smallest app to serve with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import uvicorn

ServerT = TypeVar("ServerT", bound=uvicorn.Server)


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that answers every request 200 ``ok`` (2 bytes), with a lifespan."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


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
