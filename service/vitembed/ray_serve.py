"""Ray Serve: the same HTTP app (``create_app``) in every replica, behind Serve's HTTP proxy.

``build_app(args)`` is the application builder that ``deploy/ray/serve_config.yaml`` names (``serve run``,
``serve deploy``); ``args["settings"]`` holds ``ServiceSettings`` fields. Each replica runs one engine with
its own models, batcher and admission, and answers every ``/v1/*`` route and error body exactly as
``vitembed serve`` does; every answer names its replica in ``X-Vitembed-Replica``.

Who sheds load: Serve. Its router sees every replica's ongoing requests; a request that no replica can take
waits in Serve's queue (``max_queued_requests``), where the autoscaler counts it, and past that queue Serve
answers 429 with ``Retry-After`` (``backpressure_config``). A replica that refused work itself could not send
it to an idle sibling, and the autoscaler would not see the refused demand. So each replica admits whatever
Serve hands it: its queue holds ``max_ongoing_requests × max_images_per_request`` images, and its
queue-delay target is its request timeout (only a request that cannot finish by its deadline is refused).
A replica whose settings break this refuses to start, with the setting to change.

Serve's proxy answers some errors itself in plain text (listed in the README; the client maps them).
``proxy_middlewares`` (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=vitembed.ray_serve:proxy_middlewares``
when the cluster starts) adds one answer of ours: a request in flight on a replica whose process died
gets 503 ``replica_unavailable`` with ``Retry-After`` in the service's JSON error body, not a bare 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vit_backbone.errors import MissingExtraError
from vitembed.server.errors import ERROR_CODES, error_body
from vitembed.settings import ServiceSettings

REPLICA_HEADER = "X-Vitembed-Replica"
DEPLOYMENT_NAME = "vitembed"
# defaults of the deployment (serve_config.yaml may override each); see the module docstring
MAX_ONGOING_REQUESTS = 8
MAX_QUEUED_REQUESTS = 64
BACKPRESSURE_RETRY_AFTER_S = 1.0
REPLICA_GONE_RETRY_AFTER_S = 1


def _serve() -> Any:
    try:
        from ray import serve
    except ImportError as exc:
        raise MissingExtraError("Ray Serve deployment", "ray") from exc
    return serve


# ------------------------------------------------------------------------------------------- settings
def replica_settings(values: Mapping[str, Any], max_ongoing_requests: int) -> ServiceSettings:
    """The replica's settings: ``values`` plus, where not given, a queue that holds everything Serve may hand
    the replica and a queue-delay target equal to the request timeout. Given values that would let the
    replica refuse Serve's work raise ValueError naming the setting."""
    settings = ServiceSettings(**values)
    # admission leaves room for n - 1 images of others beside a request of n (engine/admission.py): the
    # last of max_ongoing_requests full requests needs (max_ongoing_requests + 1) * n - 1 places
    need = (max_ongoing_requests + 1) * settings.max_images_per_request - 1
    update: dict[str, Any] = {}
    if "queue_size" not in values:
        update["queue_size"] = max(settings.queue_size, need)
    elif settings.queue_size < need:
        raise ValueError(
            f"settings.queue_size={settings.queue_size} cannot hold the {need} images Serve may hand a "
            f"replica (max_ongoing_requests={max_ongoing_requests} x max_images_per_request="
            f"{settings.max_images_per_request}); Serve sheds load in this deployment: set queue_size >= "
            f"{need} or lower max_ongoing_requests"
        )
    if settings.max_concurrent_requests < max_ongoing_requests:
        raise ValueError(
            f"settings.max_concurrent_requests={settings.max_concurrent_requests} is under Serve's "
            f"max_ongoing_requests={max_ongoing_requests}: the replica would answer 503 server_busy to work "
            f"Serve admitted; set max_concurrent_requests >= {max_ongoing_requests}"
        )
    if "queue_delay_target_s" not in values:
        update["queue_delay_target_s"] = settings.request_timeout_s
    elif settings.queue_delay_target_s < settings.request_timeout_s:
        raise ValueError(
            f"settings.queue_delay_target_s={settings.queue_delay_target_s:g} is under request_timeout_s="
            f"{settings.request_timeout_s:g}: the replica would refuse work Serve already admitted; Serve "
            "sheds load in this deployment (max_queued_requests): drop queue_delay_target_s"
        )
    return settings.model_copy(update=update) if update else settings


# ------------------------------------------------------------------------------------------- ASGI wrappers
class ReplicaHeaderMiddleware:
    """In the replica: every answer names the replica; the request id header is left to Serve's proxy,
    which adds the same id (the app takes it from the request header the proxy set)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*kept, self.header]}
            await send(message)

        await self.app(scope, receive, send_named)


class ReplicaGoneMiddleware:
    """In Serve's proxy: when a request ends without any answer (its replica's process died mid-request,
    which the proxy would answer with a bare 500), answer 503 ``replica_unavailable`` with ``Retry-After``
    in the service's error body; another replica takes the retry."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if started:
                raise
        if not started:
            await send_replica_gone(scope, send)


async def send_replica_gone(scope: Scope, send: Send) -> None:
    rid = next(
        (v.decode("latin-1") for k, v in scope.get("headers") or () if k.lower() == b"x-request-id"), ""
    )
    body = json.dumps(
        error_body(
            "replica_unavailable",
            "the replica serving this request stopped before answering; retry (another replica takes it)",
            rid,
        ),
        separators=(",", ":"),
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": ERROR_CODES["replica_unavailable"],
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(REPLICA_GONE_RETRY_AFTER_S).encode()),
                (b"x-request-id", rid.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """For ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=vitembed.ray_serve:proxy_middlewares``."""
    return [Middleware(ReplicaGoneMiddleware)]


# ------------------------------------------------------------------------------------------- deployment
def deployment() -> Any:
    """The Serve deployment class (built on call, so that importing this module needs no Ray)."""
    serve = _serve()
    from vitembed.server.app import create_app

    @serve.deployment(
        name=DEPLOYMENT_NAME,
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        max_queued_requests=MAX_QUEUED_REQUESTS,
        backpressure_config={"status_code": 429, "retry_after_s": BACKPRESSURE_RETRY_AFTER_S},
        health_check_period_s=2,
        graceful_shutdown_timeout_s=30,
    )
    @serve.ingress()
    class VitembedReplica:
        def __init__(self, settings: dict[str, Any]) -> None:
            context = serve.get_replica_context()
            config = getattr(context, "_deployment_config", None)  # Serve's own limits, as deployed
            ongoing = int(getattr(config, "max_ongoing_requests", MAX_ONGOING_REQUESTS))
            self.settings = replica_settings(settings, ongoing)
            self.replica = str(context.replica_id.unique_id)

        def __serve_build_asgi_app__(self) -> ASGIApp:
            return ReplicaHeaderMiddleware(create_app(self.settings), self.replica)

    return VitembedReplica


def build_app(args: Mapping[str, Any]) -> Any:
    """The application builder (``import_path: vitembed.ray_serve:build_app``): ``args["settings"]`` holds
    ``ServiceSettings`` fields (models, precision, limits...); checked here, before anything deploys."""
    unknown = sorted(set(args) - {"settings"})
    if unknown:
        raise ValueError(f"unknown application args {unknown}: put ServiceSettings fields under 'settings'")
    settings = dict(args.get("settings") or {})
    replica_settings(settings, MAX_ONGOING_REQUESTS)  # a bad value stops the deploy with its message
    return deployment().bind(settings)
