"""The served indexes as a request sees them: the app's ``SearchState``, picking an index by name, running
a query on the search pool within the request's deadline (504 past it), and a table changed or dropped
under the server as a clear status (409 / 503), never a 500 or stale options. Used by the search and the
explorer routes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from fastapi import Request

from vit_backbone.catalog.index_search import IndexChangedError, IndexDroppedError
from vitembed.engine.engine import DeadlineExceededError
from vitembed.engine.served_indexes import SearchState, ServedIndex
from vitembed.server.deadlines import budget_s
from vitembed.server.errors import ApiError

T = TypeVar("T")


def search_state(request: Request) -> SearchState:
    state = getattr(request.app.state, "indexes", None)
    return state if isinstance(state, SearchState) else SearchState({})


def served_indexes(request: Request) -> dict[str, ServedIndex]:
    return search_state(request).indexes


@contextmanager
def table_errors(served: ServedIndex) -> Iterator[None]:
    """A table overwritten or dropped under the server: a clear status, never a 500 or stale options."""
    try:
        yield
    except IndexChangedError as exc:
        raise ApiError(
            409,
            "index_changed",
            f"index {served.name!r} was rebuilt in a way the served models cannot query; rebuild it with a "
            f"served model, or serve its model ({exc})",
        ) from exc
    except IndexDroppedError as exc:
        raise ApiError(
            503,
            "index_dropped",
            f"index {served.name!r} ({served.index.db}:{served.index.name}) was dropped or moved; it is "
            "served again once the table is rebuilt there",
        ) from exc


async def run_search_work(request: Request, func: Callable[[], T], deadline: float) -> T:
    """``func`` on the search pool, raced against the request deadline (504 past it). A query already
    running finishes on its thread; one still queued is dropped."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(search_state(request).executor, func)
    try:
        return await asyncio.wait_for(future, timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        timeout = budget_s(request)
        raise DeadlineExceededError(f"no result within {timeout:g} s") from exc


def pick_index(indexes: dict[str, ServedIndex], name: str | None) -> ServedIndex:
    if not indexes:
        raise ApiError(
            404, "index_not_found", "no index is served: start the server with --index NAME=DB_PATH:TABLE"
        )
    if name is None:
        if len(indexes) > 1:
            raise ApiError(
                422,
                "index_required",
                f"several indexes are served; name one with 'index': {', '.join(indexes)}",
            )
        return next(iter(indexes.values()))
    served = indexes.get(name)
    if served is None:
        raise ApiError(
            404, "index_not_found", f"index {name[:64]!r} is not served; served: {', '.join(indexes)}"
        )
    return served
