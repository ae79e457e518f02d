"""``vitembed embed-catalog``: argument parsing and the run function registered in service/cli.py.

Heavy imports (torch, the model, pyarrow, ray) happen inside ``run_embed_catalog`` so that ``vitembed
--help`` stays instant. Ctrl-C asks the job to stop: rows already embedded are committed and the command
exits with status 130; running it again with the same arguments resumes. A second Ctrl-C aborts at once
(the next run still resumes from the last committed shard).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

EXIT_INTERRUPTED = 130  # the shell's convention for "stopped by SIGINT"
POOLING_CHOICES = ("cls", "pooler", "mean", "cls_mean", "gem", "linear_eval")
POLICY_CHOICES = ("crop", "squash", "pad", "dynamic")


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
        default="embedded",
        metavar="[NAME=]PATH_OR_ID",
        help="a checkpoint folder, a hub id from the local cache, or 'embedded' (default)",
    )
    parser.add_argument("--pooling", choices=POOLING_CHOICES, help="default: the model's")
    parser.add_argument(
        "--layers", nargs="+", metavar="I", help="block indices, e.g. 8 or -4 -3 -2 -1 (default: the model's)"
    )
    parser.add_argument(
        "--size", nargs="+", metavar="H W", help="input size, 'H W' or 'HxW' (default: the model's)"
    )
    parser.add_argument("--policy", choices=POLICY_CHOICES, help="resize policy (default: the model's)")
    parser.add_argument("--normalize", action="store_true", help="L2-normalise the vectors")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="storage dtype")
    parser.add_argument(
        "--precision",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="compute precision; auto = bfloat16 autocast only where native, faster and cosine ≥ 0.999",
    )
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto (default auto)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per forward pass (default 16)")
    parser.add_argument("--workers", type=int, default=2, help="decode/preprocess threads (default 2)")
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
    parser.add_argument("--progress", action="store_true", help="show the progress bar even off a terminal")


def parse_model(arg: str) -> tuple[str, str]:
    """``NAME=TARGET`` → (NAME, TARGET); a folder → (its name, path); anything else names itself."""
    name, sep, target = arg.partition("=")
    if sep and name and "/" not in name and target:
        return name, target
    folder = Path(arg).expanduser()
    if folder.is_dir():
        return folder.resolve().name, str(folder)
    return arg, arg


def parse_size(values: list[str] | None) -> tuple[int, int] | None:
    if not values:
        return None
    parts = [p for v in values for p in v.lower().replace("x", " ").replace(",", " ").split()]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 2 or min(numbers) < 1:
        raise ValueError(f"--size takes 'H W' or 'HxW' with positive integers, got {' '.join(values)!r}")
    return numbers[0], numbers[1]


def parse_layers(values: list[str] | None) -> tuple[int, ...] | None:
    if not values:
        return None
    parts = [p for v in values for p in v.replace(",", " ").split()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"--layers takes block indices such as 8 or -4 -3 -2 -1, got {' '.join(values)!r}"
        ) from None


class _StopOnSigint:
    """First Ctrl-C: set ``stop`` (the job commits and returns). Second: the default (abort)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.previous: Any = None

    def __enter__(self) -> _StopOnSigint:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        print(
            "\nstopping: committing the rows embedded so far (Ctrl-C again to abort now)",
            file=sys.stderr,
            flush=True,
        )
        self.stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def run_embed_catalog(args: argparse.Namespace) -> int:
    from vit_backbone.errors import InvalidOptionError, MissingExtraError

    try:
        size, layers = parse_size(args.size), parse_layers(args.layers)
        from .job import RunSettings

        settings = RunSettings(batch_size=args.batch_size, workers=args.workers, shard_size=args.shard_size)
    except ValueError as exc:
        raise InvalidOptionError(str(exc)) from exc
    if args.engine == "local" and (args.ray_address or args.actors):
        raise InvalidOptionError("--ray-address and --actors need --engine ray")
    if args.actors is not None and args.actors < 1:
        raise InvalidOptionError("--actors must be at least 1")
    if args.engine == "ray":
        from .ray_engine import require_ray

        require_ray()
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("vitembed embed-catalog", "catalog") from exc

    from vit_backbone import load_backbone
    from vit_backbone.precision import pick_device

    from .output import EmbedSpec, JobRecord, check_existing, open_output, resolve_meta, stored_precision
    from .precision import choose_precision
    from .progress import ProgressBar
    from .sources import open_source

    name, target = parse_model(args.model)
    spec = EmbedSpec(
        pooling=args.pooling,
        layers=layers,
        size=size,
        policy=args.policy,
        normalize=args.normalize,
        dtype=args.dtype,
        precision=args.precision,
    )
    source = open_source(args.source)
    try:
        device = pick_device(args.device)
    except ValueError as exc:
        raise InvalidOptionError(str(exc)) from exc
    backbone = load_backbone(target, device=device)
    meta = resolve_meta(backbone, name, spec)
    out = Path(args.out).expanduser().resolve()
    record = JobRecord(
        source=source.location,
        source_kind=source.kind,
        extra_columns=list(source.extra_columns),
        precision=args.precision,
        precision_used="",
        items=len(source.items),
    )
    if out.is_dir():
        check_existing(out, meta, record)  # refuse other options before spending time on the precision probe
    precision = stored_precision(out) if out.is_dir() else None
    if precision is None:
        try:
            precision = choose_precision(
                backbone,
                args.precision,
                pooling=meta.pooling,
                layers=meta.layers,
                size=size,
                policy=meta.policy,
            )
        except ValueError as exc:
            raise InvalidOptionError(str(exc)) from exc
    else:
        from .precision import apply_precision

        apply_precision(backbone, precision)
    record = JobRecord(**{**record.__dict__, "precision_used": precision})
    state = open_output(out, meta, record, source)
    todo = len(source.items) - len(state.done)
    print(
        f"embed-catalog: {len(source.items)} images in {source.location} ({len(state.done)} already done) "
        f"-> {out}; model {name} ({meta.revision}), pooling {meta.pooling}, layers {meta.layers}, "
        f"policy {meta.policy}, dim {meta.dim}, {meta.dtype}, compute {precision}, engine {args.engine}",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    with _StopOnSigint(stop), ProgressBar(todo, force=args.progress) as bar:
        if args.engine == "ray":
            from .ray_engine import RayOptions, run_ray

            options = RayOptions(
                address=args.ray_address, actors=args.actors, model=target, precision=precision
            )
            summary = run_ray(backbone, source, state, settings, options, stop=stop, progress=bar.update)
        else:
            from .job import run_local

            summary = run_local(backbone, source, state, settings, stop=stop, progress=bar.update)
    print(summary.line(), flush=True)
    return EXIT_INTERRUPTED if summary.interrupted else 0
