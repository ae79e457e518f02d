"""HTTP plumbing every route module shares: dependencies (settings, metrics, a ready engine), reading the
body, offloading a large parse, content negotiation, and engine work raced against the client's disconnect
and the deadline. No routes here and no model logic: a route module is parse → engine → serialise on top.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from starlette.requests import ClientDisconnect

from vitembed.engine.engine import (
    DeadlineExceededError,
    EmbedOptions,
    EmbedOutcome,
    Engine,
    NotReadyError,
    RequestTicket,
)
from vitembed.metrics import Metrics
from vitembed.server.deadlines import budget_s
from vitembed.server.early_refusal import LEASE_SCOPE_KEY
from vitembed.server.errors import CLIENT_CLOSED, ApiError
from vitembed.server.quotas import check_quota
from vitembed.server.schemas import ErrorResponse
from vitembed.server.serialise import NPY_MEDIA_TYPE
from vitembed.settings import ServiceSettings

DISCONNECT_POLL_S = 0.05
DEADLINE_GRACE_S = 1.0  # the engine answers 504 itself at the deadline; this is the app's own backstop
JSON_MEDIA_TYPE = "application/json"
OFFLOAD_BODY_BYTES = 1 << 20  # parse and base64-decode bigger bodies in a thread
T = TypeVar("T")


# ------------------------------------------------------------------------------------------- dependencies
# Coroutines, though they never await: FastAPI runs a plain ``def`` dependency in a worker thread, and three
# thread hand-offs per request (a queue put, a wake-up, the GIL passed back and forth) were a tenth of the
# event loop's time under a flood, taken from the forward thread's GIL
async def get_settings(request: Request) -> ServiceSettings:
    settings: ServiceSettings = request.app.state.settings
    return settings


async def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


async def get_engine(request: Request) -> Engine:
    """The engine, if it can take work now: 503 while models load or when a worker has stopped."""
    engine: Engine | None = getattr(request.app.state, "engine", None)
    if engine is None or not engine.ready:
        raise NotReadyError("the models are not ready (loading, or a model worker stopped)")
    return engine


SettingsDep = Annotated[ServiceSettings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
EngineDep = Annotated[Engine, Depends(get_engine)]

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "bad body: not JSON/multipart, no images, invalid base64, undecodable image",
        401: "missing or wrong bearer token (when the server has an API key)",
        404: "unknown model",
        413: "body over max_body_bytes, too many images, or an image over the byte limit",
        415: "wrong Content-Type or an image format that is not accepted",
        422: "options that cannot be honoured, or an image over the pixel / aspect-ratio limits",
        429: "refused at admission, or over the caller's quota (quota_exceeded); see Retry-After",
        500: "internal error, or non-finite model output (code non_finite)",
        503: "models not ready",
        504: "request deadline passed",
    }.items()
}


# ------------------------------------------------------------------------------------------- the body
async def read_body(request: Request) -> bytes:
    """The whole body, before anything else touches ``receive`` (an early disconnect check can swallow
    body bytes); the body limit is enforced underneath by BodyLimitMiddleware."""
    try:
        body = await request.body()
    except ClientDisconnect as exc:
        raise ApiError(CLIENT_CLOSED, "client_closed_request", "the client went away") from exc
    if not body:
        raise ApiError(400, "empty_body", "the request body is empty")
    return body


async def offload(size: int, func: Callable[..., T], *args: Any) -> T:
    """``func(*args)``: on a thread for a body over ``OFFLOAD_BODY_BYTES`` (parsing and base64-decoding it
    would hold the event loop), inline otherwise."""
    return await asyncio.to_thread(func, *args) if size > OFFLOAD_BODY_BYTES else func(*args)


def unsupported_media_type(accepted: str) -> ApiError:
    return ApiError(415, "unsupported_media_type", f"send the request as {accepted}")


def wants_npy(accept: str | None) -> bool:
    """``Accept`` lists application/x-npy with a non-zero quality."""
    for entry in (accept or "").split(","):
        kind, *params = (part.strip().lower() for part in entry.split(";"))
        if kind == NPY_MEDIA_TYPE:
            for param in params:
                name, _, value = param.partition("=")
                if name.strip() == "q":
                    try:
                        return float(value) > 0
                    except ValueError:
                        return False
            return True
    return False


# ------------------------------------------------------------------------------------------- engine work
def refuse_early(
    request: Request, engine: Engine, settings: ServiceSettings, model: str | None, deadline: float
) -> None:
    """429 before the body is read when not even one image could be admitted now: first the caller's quota
    (``quotas.py``), then the server's admission for the model named in the query, or the only one served
    (a model named in the body is checked after the parse). The request-head gate checks the same: a place
    it already leased for this request (in the scope) is taken over, not checked again."""
    check_quota(request)
    if model is None and len(settings.models) == 1:
        model = next(iter(settings.models))
    if model is not None and model in engine.model_names:
        held = request.scope.get(LEASE_SCOPE_KEY)
        lease = held[1] if held is not None and held[0] == model else None
        engine.refuse_early(model, deadline, lease=True, held=lease)


async def run_engine(
    request: Request,
    engine: Engine,
    model: str,
    images: Sequence[bytes],
    options: EmbedOptions,
    deadline: float,
) -> EmbedOutcome:
    """``engine.embed`` raced against the client's disconnect and the deadline (``race_client``)."""
    ticket = RequestTicket(deadline, budget_s(request))
    return await race_client(
        request, ticket, engine.embed(model, images, options, ticket=ticket, deadline=deadline), deadline
    )


async def race_client(
    request: Request, ticket: RequestTicket, coroutine: Coroutine[Any, Any, T], deadline: float
) -> T:
    """Engine work raced against the client's disconnect and the deadline; whichever loses is cancelled,
    and a cancelled ticket drops the request's items still queued."""
    work = asyncio.ensure_future(coroutine)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        timeout = max(0.0, deadline - time.monotonic()) + DEADLINE_GRACE_S
        done, _ = await asyncio.wait({work, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        if watcher in done:
            raise ApiError(CLIENT_CLOSED, "client_closed_request", "the client went away")
        raise DeadlineExceededError(f"no result within {budget_s(request):g} s")
    finally:
        watcher.cancel()
        watcher.add_done_callback(_consume)
        if not work.done():
            ticket.cancel()
            work.cancel()
        work.add_done_callback(_consume)


async def _watch_disconnect(request: Request) -> None:
    """Returns when the client has gone; only started once the body is fully read.

    Waits on the server's own ``receive``, which, once the body is in, returns only when the connection is
    lost (or the response is complete): no polling. ``Request.is_disconnected`` polled every 50 ms cost
    each waiting request an AnyIO cancel scope per poll, on the event loop: under a flood ~128 admitted
    requests wait at once, and the polls took a tenth of a core's GIL time from the forward thread."""
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(DISCONNECT_POLL_S)  # a server that answers at once: never spin


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so an abandoned task's error is not logged as "never retrieved"
