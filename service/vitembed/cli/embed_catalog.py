"""``vitembed embed-catalog``: argument parsing and the run function registered in service/cli.py.

Heavy imports (torch, the model, pyarrow, ray) happen inside ``run_embed_catalog`` so that ``vitembed
--help`` stays instant. Ctrl-C (SIGINT) or SIGTERM asks the job to stop: rows already embedded are
committed and the command exits with status 130 (SIGINT) or 143 (SIGTERM), the shell's 128 + signal
number; running it again with the same arguments resumes. A second signal aborts at once, without a
traceback (the next run still resumes from the last committed shard).

``--server URL`` sends the images to a running ``vitembed serve`` instead of loading the model here
(``remote_catalog.py``); the catalog it writes is the same, and either path resumes the other's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from vit_backbone.pooling_names import POOLINGS
from vit_backbone.presets import DEFAULT_PRESET, PRESET_NAMES
from vitembed.cli.options import DEFAULT_DEVICE, DEVICE_HELP, add_layers, add_server, add_size
from vitembed.cli.stop_signals import EXIT_CODES, StopOnSignals

if TYPE_CHECKING:
    from vit_backbone.backbone import Backbone
    from vit_backbone.catalog.job_folder import JobFile
    from vit_backbone.catalog.meta import CatalogMeta

POOLING_CHOICES = tuple(p for p in POOLINGS if p != "patch")  # a catalog stores one vector per image
POLICY_CHOICES = ("crop", "squash", "pad", "dynamic", "trim_squash", "trim_pad")


def configure_embed_catalog(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="a folder of images (recursive; id = path relative to it) or a manifest "
        "(.csv, .jsonl, .parquet) with 'id' and 'path' columns; other columns are kept",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the catalog folder (created or resumed)")
    parser.add_argument(
        "--model",
        metavar="[NAME=]PATH_OR_ID",
        help="a checkpoint folder, a hub id from the local cache, or 'embedded' (default); with --server "
        "the name of a served model (default: the server's default model)",
    )
    parser.add_argument("--pooling", choices=POOLING_CHOICES, help="default: the model's")
    add_layers(parser, "block indices (default: the model's)")
    add_size(parser)
    parser.add_argument("--policy", choices=POLICY_CHOICES, help="resize policy (default: the model's)")
    parser.add_argument(
        "--preset", choices=PRESET_NAMES, help=f"named defaults for the options not given ({DEFAULT_PRESET})"
    )
    parser.add_argument("--normalize", action="store_true", help="L2-normalise the vectors")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="storage dtype")
    parser.add_argument(
        "--precision",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="compute precision; auto (the server's rule) = bfloat16 autocast only where native, not "
        "slower and cosine ≥ 0.999 to float32; float16 needs CUDA; with --server: the server's (auto "
        "records it, another value is refused)",
    )
    parser.add_argument(
        "--device",
        help=f"{DEVICE_HELP} (default: {DEFAULT_DEVICE}); not with --server (the server's device is used)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="images per forward pass (default 8, the fastest measured); with --server, images per request",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="decode/preprocess threads (default 2); with --engine ray the concurrent decode tasks "
        "(default: Ray Data decides)",
    )
    parser.add_argument("--shard-size", type=int, default=4096, metavar="ROWS", help="rows per Parquet shard")
    parser.add_argument("--engine", choices=("local", "ray"), default="local", help="default local")
    parser.add_argument(
        "--ray-address", metavar="ADDR", help="an existing Ray cluster (e.g. ray://head:10001 or 'auto')"
    )
    parser.add_argument(
        "--actors",
        type=int,
        metavar="N",
        help="Ray embedder actors (default: one per GPU, or 1 without GPUs)",
    )
    add_server(
        parser,
        "send the images to a running `vitembed serve` (e.g. http://127.0.0.1:8000) instead of loading the "
        "model here; same catalog; not with --engine ray, --device, --workers",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="with --server: requests in flight (default 4), so the server batches them together",
    )
    parser.add_argument(
        "--retry-for",
        type=float,
        metavar="SECONDS",
        help="with --server: how long one request keeps retrying 429/503 answers and refused connections "
        "before the job stops, resumable (default 60)",
    )
    parser.add_argument("--progress", action="store_true", help="show the progress bar even off a terminal")
    parser.add_argument(
        "--retry-errors",
        nargs="*",
        metavar="CODE",
        help="before running, drop these codes (all when none is given) from errors.jsonl so those images "
        "are tried again, e.g. --retry-errors read_error internal_error",
    )


def parse_model(arg: str) -> tuple[str, str]:
    """``NAME=TARGET`` → (NAME, TARGET); a folder → (its name, path); anything else names itself."""
    name, sep, target = arg.partition("=")
    if sep and name and "/" not in name and target:
        folder = Path(target).expanduser()
        return name, str(folder.resolve()) if folder.is_dir() else target
    folder = Path(arg).expanduser()
    if folder.is_dir():  # absolute, so Ray workers (other working directories) load the same folder
        return folder.resolve().name, str(folder.resolve())
    return arg, arg


def run_embed_catalog(args: argparse.Namespace) -> int:
    stopper = StopOnSignals(threading.Event())
    try:
        status = _run(args, stopper)
    except KeyboardInterrupt:
        signum = stopper.received or signal.SIGINT
        print(
            "\naborted: rows in committed shards and errors.jsonl are kept; run the same command again to "
            "resume",
            file=sys.stderr,
            flush=True,
        )
        status = EXIT_CODES[signal.Signals(signum)]
    if stopper.received:
        _exit_now(status)
    return status


def _exit_now(status: int) -> NoReturn:
    """After a stop signal everything kept is already committed (shards and errors.jsonl fsynced): leave
    without interpreter teardown, which can abort the process ("terminate called without an active
    exception") while decode threads and torch's thread pool are still being torn down."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(args: argparse.Namespace, stopper: StopOnSignals) -> int:
    from vit_backbone.errors import InvalidOptionError, MissingExtraError

    try:
        size, layers = args.size, args.layers
        from vit_backbone.catalog.local_engine import RunSettings

        workers = 2 if args.workers is None or args.engine == "ray" else args.workers
        settings = RunSettings(batch_size=args.batch_size, workers=workers, shard_size=args.shard_size)
    except ValueError as exc:
        raise InvalidOptionError(str(exc)) from exc
    if args.engine == "local" and (args.ray_address or args.actors):
        raise InvalidOptionError("--ray-address and --actors need --engine ray")
    for flag, value in (("--actors", args.actors), ("--workers", args.workers)):
        if value is not None and value < 1:
            raise InvalidOptionError(f"{flag} must be at least 1")
    _check_server_flags(args)
    if args.engine == "ray":
        from vit_backbone.catalog.ray_engine import require_ray

        require_ray()
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("vitembed embed-catalog", "catalog") from exc
    from vitembed.cli.progress import require_tqdm

    require_tqdm()
    if args.server:
        return _embed_remote(args, stopper, settings)
    return _embed(args, stopper, settings, size, layers)


def _check_server_flags(args: argparse.Namespace) -> None:
    """What ``--server`` cannot honour (the server decodes and runs the model) is refused in one line."""
    from vit_backbone.errors import InvalidOptionError

    if args.server:
        given = [
            flag
            for flag, value in (
                ("--engine ray", args.engine == "ray"),
                ("--device", args.device is not None),
                ("--workers", args.workers is not None),
                ("--ray-address", args.ray_address),
                ("--actors", args.actors),
            )
            if value
        ]
        if given:
            raise InvalidOptionError(
                f"{', '.join(given)} cannot be used with --server: the server decodes the images and runs "
                "the model on its own device (set them on `vitembed serve`); use --concurrency for requests "
                "in flight"
            )
        for flag, number in (("--concurrency", args.concurrency), ("--retry-for", args.retry_for)):
            if number is not None and not number > 0:
                raise InvalidOptionError(f"{flag} must be positive, got {number:g}")
    else:
        given = [
            flag
            for flag, value in (("--concurrency", args.concurrency), ("--retry-for", args.retry_for))
            if value is not None
        ]
        if given:
            raise InvalidOptionError(f"{', '.join(given)} needs --server URL")


def _embed_remote(args: argparse.Namespace, stopper: StopOnSignals, settings: Any) -> int:
    """``--server``: the same folder, job file and resume rules as ``_embed``, the server embedding."""
    import dataclasses

    from vit_backbone.catalog.error_log import ERRORS_FILE
    from vit_backbone.catalog.job_folder import (
        EmbedSpec,
        JobRecord,
        OutputLock,
        check_existing,
        open_output,
        read_job_file,
    )
    from vit_backbone.catalog.sources import open_source
    from vit_backbone.errors import InvalidOptionError
    from vitembed.cli.progress import ProgressBar
    from vitembed.cli.remote import connect
    from vitembed.cli.remote_catalog import RemoteOptions, resolve_served, retry_policy, run_remote

    remote = RemoteOptions(
        args.server,
        args.api_key,
        args.model,
        concurrency=args.concurrency or 4,
        retry_for=60.0 if args.retry_for is None else args.retry_for,
    )
    spec = EmbedSpec(
        args.pooling,
        args.layers,
        args.size,
        args.policy,
        args.normalize,
        args.dtype,
        args.precision,
        args.preset,
    )
    source = open_source(args.source)
    out = Path(args.out).expanduser().resolve()
    with connect(remote.url, remote.api_key, retry_policy(remote)) as client:
        job = resolve_served(client, remote, spec)
        record = JobRecord(
            source.location,
            source.kind,
            source.extra_columns,
            args.precision,
            job.precision,
            len(source.items),
        )
        if out.is_dir():
            check_existing(out, job.meta, record)  # refuse other options before creating the lock file
        with OutputLock(out):
            found = read_job_file(out)
            if found is not None:
                check_existing(out, job.meta, record)  # again, under the lock
                if found.record.precision_used not in ("", job.precision):
                    raise InvalidOptionError(
                        f"{out} was embedded in {found.record.precision_used} and the server computes in "
                        f"{job.precision}: one catalog never mixes precisions; start the server with "
                        f"--precision {found.record.precision_used}, or write to a new --out folder"
                    )
                record = dataclasses.replace(record, precision_used=found.record.precision_used)
            state = open_output(out, job.meta, record, source, retry=_retry(args.retry_errors))
            meta = job.meta
            print(
                f"embed-catalog: {len(source.items)} images in {source.location} ({len(state.done)} already "
                f"done{f', {state.retried} failures to retry' if state.retried else ''}) -> {out}; model "
                f"{meta.model} ({meta.revision}) on {remote.url}, pooling {meta.pooling}, layers "
                f"{meta.layers}, policy {meta.policy}, dim {meta.dim}, {meta.dtype}, compute {job.precision}"
                ", "
                f"{settings.batch_size} images a request, {remote.concurrency} in flight",
                file=sys.stderr,
                flush=True,
            )
            todo = len(source.items) - len(state.done)
            with stopper, ProgressBar(todo, force=args.progress) as bar:
                summary = run_remote(
                    client, job, source, state, settings, remote, stop=stopper.stop, progress=bar.update
                )
    print(summary.line(errors_file=str(Path(args.out) / ERRORS_FILE)), flush=True)
    if not summary.interrupted:
        return 0
    return EXIT_CODES[signal.Signals(stopper.received or signal.SIGINT)]


def _embed(
    args: argparse.Namespace,
    stopper: StopOnSignals,
    settings: Any,
    size: tuple[int, int] | None,
    layers: tuple[int, ...] | None,
) -> int:
    import dataclasses

    from vit_backbone import load_backbone
    from vit_backbone.catalog.job_folder import (
        EmbedSpec,
        JobRecord,
        OutputLock,
        check_existing,
        open_output,
        read_job_file,
        resolve_meta,
    )
    from vit_backbone.catalog.sources import open_source
    from vit_backbone.errors import InvalidOptionError
    from vit_backbone.precision import autocast_dtype, pick_device
    from vitembed.cli.progress import ProgressBar

    name, target = parse_model(args.model or "embedded")
    spec = EmbedSpec(
        args.pooling, layers, size, args.policy, args.normalize, args.dtype, args.precision, args.preset
    )
    source = open_source(args.source)
    try:
        device = pick_device(args.device or DEFAULT_DEVICE)
        if args.engine == "local":
            autocast_dtype(args.precision, device)  # float16 without CUDA: refused before any file is made
    except ValueError as exc:
        raise InvalidOptionError(str(exc)) from exc
    backbone = load_backbone(target, device=device)
    meta = resolve_meta(backbone, name, spec)
    out = Path(args.out).expanduser().resolve()
    record = JobRecord(
        source.location, source.kind, source.extra_columns, args.precision, "", len(source.items)
    )
    if out.is_dir():
        check_existing(out, meta, record)  # refuse other options before creating the lock file
    with _ray_session(args), OutputLock(out):
        found = read_job_file(out)
        if found is not None:
            check_existing(out, meta, record)  # again, under the lock
        precision, meta = _precision(args, backbone, meta, found, settings.batch_size, size)
        record = dataclasses.replace(record, precision_used=precision)
        state = open_output(out, meta, record, source, retry=_retry(args.retry_errors))
        print(
            f"embed-catalog: {len(source.items)} images in {source.location} ({len(state.done)} already done"
            f"{f', {state.retried} failures to retry' if state.retried else ''}) -> {out}; model {name} "
            f"({meta.revision}), pooling {meta.pooling}, layers {meta.layers}, policy {meta.policy}, "
            f"dim {meta.dim}, {meta.dtype}, compute {precision}, engine {args.engine}",
            file=sys.stderr,
            flush=True,
        )
        todo = len(source.items) - len(state.done)
        with stopper, ProgressBar(todo, force=args.progress) as bar:
            if args.engine == "ray":
                from vit_backbone.catalog.ray_engine import RayOptions, run_ray

                ray_options = RayOptions(
                    args.ray_address, args.actors, target, precision, "auto", args.workers
                )
                summary = run_ray(
                    backbone, source, state, settings, ray_options, stop=stopper.stop, progress=bar.update
                )
            else:
                from vit_backbone.catalog.local_engine import run_local

                summary = run_local(backbone, source, state, settings, stop=stopper.stop, progress=bar.update)
    from vit_backbone.catalog.error_log import ERRORS_FILE

    print(summary.line(errors_file=str(Path(args.out) / ERRORS_FILE)), flush=True)
    if not summary.interrupted:
        return 0
    return EXIT_CODES[signal.Signals(stopper.received or signal.SIGINT)]


def _precision(
    args: argparse.Namespace,
    backbone: Backbone,
    meta: CatalogMeta,
    found: JobFile | None,
    batch_size: int,
    size: tuple[int, int] | None,
) -> tuple[str, CatalogMeta]:
    """The compute precision and the meta recording it: a resumed catalog keeps its stored choice (one
    catalog never mixes precisions); the Ray engine takes the explicit one (each actor applies it on its
    own hardware); otherwise the shared rule measures this machine with the job's options."""
    import dataclasses

    from vit_backbone.catalog.precision import apply_precision, choose_precision
    from vit_backbone.errors import InvalidOptionError
    from vit_backbone.preprocess_config import literal_size

    if found is not None and found.record.precision_used:
        apply_precision(backbone, found.record.precision_used)
        return found.record.precision_used, dataclasses.replace(meta, precision=found.meta.precision)
    if args.engine == "ray":  # auto: decided by a task on a worker (its hardware runs the model)
        precision = args.precision
        if precision == "auto":
            from vit_backbone.catalog.ray_engine import decide_precision

            stored = None if meta.size is None else (meta.size[0], meta.size[1])
            precision = decide_precision(_ray_model(args), meta, stored, batch_size)
            print(f"embed-catalog: --precision auto -> {precision}, decided on a Ray worker", file=sys.stderr)
    else:
        options = {"pooling": meta.pooling, "layers": meta.layers, "size": literal_size(meta.size)}
        options["policy"] = meta.policy
        try:
            precision = choose_precision(backbone, args.precision, batch_size=batch_size, **options).label
        except ValueError as exc:
            raise InvalidOptionError(str(exc)) from exc
    return precision, dataclasses.replace(meta, precision=precision)


def _ray_model(args: argparse.Namespace) -> str:
    return parse_model(args.model or "embedded")[1]


def _ray_session(args: argparse.Namespace) -> Any:
    """The Ray session the job runs in (deciding the precision and embedding share it), or nothing."""
    import contextlib

    if args.engine != "ray":
        return contextlib.nullcontext()
    from vit_backbone.catalog.ray_engine import ray_session

    return ray_session(args.ray_address)


def _retry(codes: list[str] | None) -> tuple[str, ...] | None:
    return None if codes is None else tuple(codes)
