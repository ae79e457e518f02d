"""``vitembed serve``: settings from flags over ``VITEMBED_*`` variables, then uvicorn on one process."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from vit_backbone.errors import MissingExtraError, ModelLoadError, VitEmbedError
from vitembed.settings_error import SettingsError as SettingsError  # re-exported: it lived here

# flag -> settings field; flags left unset fall back to VITEMBED_* variables, then to the defaults
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--host": ("host", str, "address to bind (default 127.0.0.1: loopback only)"),
    "--port": ("port", int, "port (default 8000)"),
    "--device": ("device", str, "cpu | cuda | auto (default auto: CUDA when available, else the CPU)"),
    "--precision": ("precision", str, "auto | float32 | bfloat16 | float16 (default auto)"),
    "--max-batch-size": ("max_batch_size", int, "images per forward pass (default 16)"),
    "--max-batch-tokens": ("max_batch_tokens", int, "patch tokens per forward pass (default 2056)"),
    "--max-wait-ms": ("max_wait_ms", float, "how long a batch waits to fill (default 5)"),
    "--queue-size": ("queue_size", int, "images queued before 429 (default 256)"),
    "--queue-delay-target-s": (
        "queue_delay_target_s",
        float,
        "admit a request only if its predicted wait fits this, else 429 + Retry-After (default 2)",
    ),
    "--decode-workers": ("decode_workers", int, "threads decoding and preprocessing (default 2)"),
    "--request-timeout-s": ("request_timeout_s", float, "per-request deadline, then 504 (default 30)"),
    "--max-concurrent-requests": (
        "max_concurrent_requests",
        int,
        "requests in flight before 503 server_busy (default 512)",
    ),
    "--body-timeout-s": ("body_timeout_s", float, "a body must arrive within this, else 408 (default 30)"),
    "--header-timeout-s": (
        "header_timeout_s",
        float,
        "a connection must send a request head within this, else it is closed (default 10)",
    ),
    "--max-body-bytes": ("max_body_bytes", int, "request body limit, then 413 (default 33554432: 32 MiB)"),
    "--max-images-per-request": ("max_images_per_request", int, "images per request, then 413 (default 64)"),
    "--cache-dir": (
        "cache_dir",
        str,
        "where the embedded checkpoint is converted (default ~/.cache/vitembed)",
    ),
    "--log-level": ("log_level", str, "debug | info | warning | error (default info)"),
    "--api-keys-file": (
        "api_keys_file",
        str,
        "JSON file of callers with their API keys and optional quotas (see README; default: none)",
    ),
}
# settings without a flag of their own: environment only
_ENV_ONLY = (
    "VITEMBED_API_KEY (bearer token for /v1/*; default: no auth)",
    "VITEMBED_TORCH_THREADS (per forward thread; default: usable CPUs / forward threads)",
    "VITEMBED_FORWARD_GRAPHS (default true: forward passes run as traced graphs, without the GIL)",
    "VITEMBED_FORWARD_WORKERS (forward threads per model; default 0 = auto: one per usable CPU up to 4 "
    "on the CPU with graphs, else 1)",
    "VITEMBED_FORWARD_NICE (default 0: the forward threads' nice value above the process's)",
    "VITEMBED_EVENT_LOOP_PRIORITY (default 5: the event-loop thread's nice value below the process's, where "
    "permitted: CAP_SYS_NICE or RLIMIT_NICE; 0: unchanged)",
    "VITEMBED_GIL_SWITCH_INTERVAL_MS (default 0.5)",
    "VITEMBED_GC_FREEZE (default true: the start-up heap is frozen out of the cyclic GC once the app is "
    "ready)",
    "VITEMBED_GC_YOUNG_THRESHOLD (default 10000: net allocations between two collections of the youngest "
    "GC generation once the app is ready; Python's is 700; 0: unchanged)",
    "VITEMBED_ENFORCE_RETRY_AFTER (default true: after a 429, a connection is read again only once its "
    "Retry-After has passed)",
    "VITEMBED_SPREAD_RETRY_AFTER (default true: refused requests are told to come back at different "
    "whole seconds)",
    "VITEMBED_ADMISSION_COUNTS_DECODE (default true: on a CPU model, images admitted but not yet decoded "
    "also count their decode time)",
    "OMP_WAIT_POLICY (default PASSIVE: OpenMP threads sleep at barriers instead of spinning)",
    "VITEMBED_MAX_IMAGE_PIXELS (default 40000000)",
    "VITEMBED_MAX_ASPECT_RATIO (default 20)",
    "VITEMBED_MAX_TOKENS_PER_IMAGE (default 4096)",
    "VITEMBED_MAX_UPSAMPLE_PIXELS (default 16000000)",
)


_PLURAL = {"--model": "VITEMBED_MODELS", "--index": "VITEMBED_INDEXES", "--head": "VITEMBED_HEADS"}


def env_name(flag: str) -> str:
    """``--max-batch-size`` -> ``VITEMBED_MAX_BATCH_SIZE`` (``--model`` -> ``VITEMBED_MODELS``)."""
    return _PLURAL.get(flag) or "VITEMBED_" + flag.removeprefix("--").replace("-", "_").upper()


def _epilog() -> str:
    flags = ", ".join(f"{flag} {env_name(flag)}" for flag in (*_PLURAL, *_FLAGS))
    return (
        f"Every flag has a VITEMBED_* environment variable (a flag given wins over it): {flags} "
        "(VITEMBED_MODELS, VITEMBED_INDEXES and VITEMBED_HEADS are JSON objects NAME -> target, e.g. "
        """VITEMBED_MODELS='{"dino": "/models/dinov2-small"}'). Environment only: """
        + "; ".join(_ENV_ONLY)
        + "."
    )


_SERVICE_EXTRA = {"uvicorn", "fastapi", "starlette", "pydantic_settings", "multipart", "prometheus_client"}


def configure_serve(parser: argparse.ArgumentParser) -> None:
    parser.epilog = _epilog()
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=PATH_OR_ID",
        help="a model to serve (repeatable): NAME=folder|hub-id|embedded, or a bare folder (named after it); "
        "default: the embedded backbone as 'embedded'",
    )
    parser.add_argument(
        "--index",
        action="append",
        default=[],
        metavar="NAME=DB_PATH:TABLE",
        help="a similarity index to serve on POST /v1/search (repeatable): a table built by `vitembed index "
        "build`, embedded by one of the served models",
    )
    parser.add_argument(
        "--head",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a frozen head to serve (repeatable): HEAD.safetensors, HEAD.json or a folder from `vitembed "
        "heads train`; it runs on the served model with its revision and preprocessing (POST /v1/classify)",
    )
    for flag, (_, kind, help_text) in _FLAGS.items():
        parser.add_argument(flag, type=kind, default=None, help=help_text)


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from vitembed.settings import parse_index_args, parse_model_args

    overrides: dict[str, Any] = {}
    if args.model:
        overrides["models"] = parse_model_args(args.model)
    if getattr(args, "index", None):
        overrides["indexes"] = parse_index_args(args.index)
    if getattr(args, "head", None):
        from vitembed.cli.heads import parse_head_args

        overrides["heads"] = parse_head_args(args.head)
    for _, (field, _, _) in _FLAGS.items():
        value = getattr(args, field, None)
        if value is not None:
            overrides[field] = value
    return overrides


def _preflight_models(settings: Any) -> None:
    """Every served model resolves (a folder, a cached hub id or ``embedded``) and its config.json is usable,
    read from its files with no weights loaded: a typo stops start-up in one line (exit status 2) instead of
    a traceback from inside the server's start-up."""
    from vit_backbone.checkpoint import checkpoint_facts

    for name, target in settings.models.items():
        try:
            checkpoint_facts(target, settings.cache_dir)
        except ModelLoadError as exc:  # found, but its config.json is unusable: the message names the file
            raise SettingsError(f"model {name!r}: {exc}") from exc
        except VitEmbedError as exc:
            raise SettingsError(f"--model {name}={target}: {exc}") from exc


def passive_openmp() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the operator set one; read once, when torch's OpenMP starts, so
    before torch is imported. OpenMP threads otherwise spin at every barrier: beside the server's own event
    loop, its load or a neighbour on the same cores, a spinning thread holds a core another thread needs
    (a batch of 4, 2 torch threads, beside a busy process: 3.5 s active, 1.3 s passive; README, "Admission
    and safety")."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_serve(args: argparse.Namespace) -> int:
    passive_openmp()  # first: nothing has imported torch yet
    try:
        from vitembed.settings import ServiceSettings
    except ImportError as exc:
        _check_service_extra(exc)
        raise
    try:  # before the heavy imports below: a bad setting fails in a fraction of a second
        settings = ServiceSettings(**settings_overrides(args))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise SettingsError(_first_error(exc)) from exc
    _preflight_models(settings)  # before loading any weights: an unusable config.json stops start-up
    if settings.indexes:  # before loading any weights: a table no served model can query stops start-up
        from vitembed.engine.served_indexes import preflight_indexes

        preflight_indexes(settings)
    if settings.heads:  # before loading any weights: a head that fits no served model stops start-up
        from vitembed.engine.served_heads import preflight_heads

        try:
            preflight_heads(settings)
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc
    try:
        import uvicorn

        from vitembed.engine.priority import raise_calling_thread, start_libuv_pool
        from vitembed.server.acceptor import run_server
        from vitembed.server.app import create_app
        from vitembed.server.connection_protocol import header_timeout_protocol
    except ImportError as exc:
        _check_service_extra(exc)
        raise
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # uvicorn handles SIGTERM itself (stop accepting, finish in-flight requests, shut down), then restores the
    # handler it found and raises the signal again: with the default handler that kills the drained process
    # (status -15). This handler turns that last step into a clean exit with status 0.
    previous = _exit_cleanly_on_sigterm()
    app = create_app(settings)
    protocol = header_timeout_protocol(
        settings.header_timeout_s,
        gate=app.state.admission_gate,
        enforce_retry_after=settings.enforce_retry_after,
        gate_done=app.state.admission_gate.request_done,
    )
    if settings.event_loop_priority:  # uvicorn's event loop runs on this thread
        start_libuv_pool(settings.host, settings.port)
        raise_calling_thread(settings.event_loop_priority)
    try:
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http=protocol or "auto",
            log_level=settings.log_level,
            timeout_graceful_shutdown=30,  # SIGTERM: stop accepting, finish in-flight requests, then exit
            access_log=False,
        )
        run_server(config)  # uvicorn.run, with every waiting connection accepted per wake-up on uvloop
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _exit_cleanly_on_sigterm() -> Any:
    """Install the SIGTERM handler uvicorn will restore and re-raise into; returns the previous one (None
    off the main thread, where uvicorn installs no handlers either)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _check_service_extra(exc: ImportError) -> None:
    """An import of the ``service`` extra failed: say which extra to install instead of a traceback."""
    if (exc.name or "").split(".")[0] in _SERVICE_EXTRA:
        raise MissingExtraError("vitembed serve", "service") from exc


def _first_error(exc: Exception) -> str:
    from pydantic import ValidationError  # here: `vitembed --help` runs without the service extra

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "settings"
        return f"invalid setting {where}: {first.get('msg')}"
    return str(exc)
