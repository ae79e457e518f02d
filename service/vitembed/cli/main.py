"""The ``vitembed`` command line.

One small function per subcommand, registered in ``SUBCOMMANDS``; adding ``serve`` or ``embed-catalog``
means adding an entry, not editing ``main``. Heavy dependencies (torch, transformers, the web framework)
are imported inside the subcommand that needs them, so ``vitembed --help`` and ``vitembed inspect
vit-b16`` stay instant and work without the ``service`` extra.

User errors (unknown model, bad size, bad arguments) print one line to stderr and exit with status 2; a
``--server`` that cannot be reached or refuses the request as a whole prints one line and exits with 1.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vit_backbone.architectures import (
    STANDARD_ARCHS,
    Arch,
    arch_from_hf_config,
    count_params,
)
from vit_backbone.checkpoint import (
    load_config,
    read_embed_defaults,
    read_processor_config,
    resolve_checkpoint,
)
from vit_backbone.costs import CostReport, cost_report, cost_reports, format_cost_table, standard_sizes
from vit_backbone.errors import ModelNotFoundError, VitEmbedError
from vit_backbone.preprocess_config import PreprocessConfig
from vit_backbone.safetensors_io import count_params_from_safetensors
from vitembed.cli.dedup import HELP as DEDUP_HELP
from vitembed.cli.dedup import configure_dedup, run_dedup
from vitembed.cli.embed_catalog import configure_embed_catalog, run_embed_catalog
from vitembed.cli.heads import configure_heads, run_heads
from vitembed.cli.index import (
    configure_eval,
    configure_index,
    configure_search,
    run_eval,
    run_index,
    run_search,
)
from vitembed.cli.options import add_size, cli_words
from vitembed.cli.parser import Parser, UsageError
from vitembed.cli.serve import SettingsError, configure_serve, run_serve

PROG = "vitembed"
EXIT_USAGE = 2  # bad arguments, unknown model, invalid size: the user's input, not a crash
EXIT_SERVER = 1  # --server unreachable, or it refused the request as a whole (code "server_error")


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: its help line, how it adds its arguments, and what it runs."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --------------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """What `inspect` describes: a standard architecture, or a checkpoint read from its headers."""

    name: str
    arch: Arch
    params: int  # exact from safetensors for a checkpoint, analytic for a standard architecture
    params_source: str  # "analytic" | "safetensors"
    path: Path | None = None
    revision: str | None = None


def _configure_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help=f"a standard architecture ({', '.join(STANDARD_ARCHS)}), a local checkpoint folder, "
        "a Hugging Face hub id, or 'embedded'",
    )
    add_size(parser, "input size, multiples of the patch (default: the native size)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")


def _resolve_folder(model: str) -> tuple[Path, str, str | None]:
    """(folder, name, revision) of a local folder, a hub id from the local cache, or ``embedded``."""
    resolved = resolve_checkpoint(model)
    return resolved.path, resolved.name, resolved.revision


def _unknown_model_hint(model: str) -> str:
    close = difflib.get_close_matches(model, list(STANDARD_ARCHS), n=3, cutoff=0.6)
    if close:
        return f"did you mean {', '.join(close)}?"
    return f"standard architectures: {', '.join(STANDARD_ARCHS)}"


def _inspect_target(model: str) -> _Target:
    arch = STANDARD_ARCHS.get(model)
    if arch is not None:
        return _Target(model, arch, count_params(arch), "analytic")
    try:
        folder, name, revision = _resolve_folder(model)
    except ModelNotFoundError as exc:
        if "/" in model or Path(model).expanduser().exists():
            raise
        raise ModelNotFoundError(
            f"unknown model {model!r}: not a standard architecture, a checkpoint folder, "
            f"or a hub id that could be resolved; {_unknown_model_hint(model)}"
        ) from exc
    config = load_config(folder)  # fields it omits take transformers' defaults
    arch = arch_from_hf_config(config)
    params = count_params_from_safetensors(folder, prefix=config.weights_prefix)
    return _Target(name, arch, params, "safetensors", folder, revision)


def _human(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return str(count)


def _describe(target: _Target, requested: CostReport) -> str:
    arch = target.arch
    if target.path is None:
        title = f"{target.name}  (standard architecture: analytic counts, no weights)"
    else:
        revision = f", revision {target.revision}" if target.revision else ""
        title = f"{target.name}  ({target.path}{revision})"
    prefix = []
    if arch.cls_token:
        prefix.append("CLS")
    if arch.registers:
        prefix.append(f"{arch.registers} registers")
    analytic = count_params(arch)
    params = f"{target.params:,} ({_human(target.params)}, {target.params_source})"
    if target.params_source != "analytic" and analytic != target.params:
        params += f"; backbone by architecture: {analytic:,}"
    pooler = {"vit": "dense + tanh on CLS", "siglip": "attention-pooling head"}.get(arch.family, "")
    rows = [
        ("family", arch.family),
        ("patch", f"{arch.patch[0]}x{arch.patch[1]} x {arch.channels} channels"),
        (
            "raw patch dim",  # P_h·P_w·C values per patch, linearly projected to the width D
            f"{requested.patch_dim} ({arch.patch[0]}x{arch.patch[1]}x{arch.channels}) "
            f"-> projected to D={requested.dim}",
        ),
        ("width D", str(arch.dim)),
        ("depth", str(arch.depth)),
        ("heads", f"{arch.heads} (head dim {arch.head_dim})"),
        ("prefix tokens", f"{arch.prefix_tokens} ({' + '.join(prefix) or 'no CLS'})"),
        (
            "native grid",
            f"{arch.native_grid[0]}x{arch.native_grid[1]} = {arch.native_grid[0] * arch.native_grid[1]} "
            f"tokens ({arch.native_size[0]}x{arch.native_size[1]} px)",
        ),
        ("pos embed", arch.pos_embed),
        ("mlp", f"{arch.mlp_kind}, hidden {arch.mlp_dim}"),
        ("pooler", pooler if arch.has_pooler else "none"),
        ("params", params),
    ]
    width = max(len(key) for key, _ in rows)
    return "\n".join([title, *(f"  {key.ljust(width)}  {value}" for key, value in rows)])


def _inspect_json(target: _Target, requested: CostReport, reports: Sequence[CostReport]) -> dict[str, Any]:
    return {
        "model": target.name,
        "path": str(target.path) if target.path is not None else None,
        "revision": target.revision,
        "arch": target.arch.to_dict(),
        "params": target.params,
        "params_source": target.params_source,
        "params_analytic": count_params(target.arch),
        "requested": requested.to_dict(),
        "reports": [r.to_dict() for r in reports],
    }


def _usage_facts(folder: Path) -> tuple[list[tuple[str, str]], tuple[int, int]]:
    """How the library will use this checkpoint (read from its files; no weights loaded): the resampling
    rule, the preprocessing and its hash, the embed defaults, and the size its own processor produces."""
    spec = load_config(folder).spec
    processor = read_processor_config(folder)
    config = PreprocessConfig.from_processor_dict(processor or spec.default_processor)
    defaults = read_embed_defaults(folder)
    resize = (
        f"shortest edge {config.shortest_edge}"
        if config.shortest_edge
        else f"{config.default_box[0]}x{config.default_box[1]}"
    )
    crop = f" -> center crop {config.crop_size[0]}x{config.crop_size[1]}" if config.crop_size else ""
    policy = defaults.get("policy", "crop")
    size = defaults.get("size")  # a preset's box (the embedded backbone's default-v3: 98x98)
    box = f"{size[0]}x{size[1]}" if size else f"{config.default_box[0]}x{config.default_box[1]}"
    if policy != "crop":  # the default policy replaces the processor's resize and crop
        resize, crop = (
            f"policy {policy}: "
            + {
                "pad": f"letterbox into {box} (aspect kept, no crop)",
                "squash": f"resize to {box} (no crop)",
                "dynamic": f"patch grid of about {box}'s tokens (aspect kept, no crop)",
                "trim_squash": f"flat borders trimmed, then resize to {box} (no crop)",
                "trim_pad": f"flat borders trimmed, then letterbox into {box}",
            }.get(policy, policy),
            "",
        )
    rule = "none (rotary positions)" if spec.pos_embed == "rope" else spec.resample_method("transformers")
    facts = [
        ("interpolation", f"transformers -> {rule} (also: reference, antialias)"),
        ("final norm", spec.final_norm),
        (
            "preprocess",
            f"{resize}{crop}, resample {config.resample}, mean {list(config.image_mean)}, "
            f"std {list(config.image_std)}" + ("" if processor else " (family default: no processor config)"),
        ),
        ("preprocess #", config.hash()),
        (
            "defaults",
            f"pooling={defaults.get('pooling', spec.default_pooling)}, "
            f"layers={defaults.get('layers')}, policy={defaults.get('policy', 'crop')}"
            + (f", size={size[0]}x{size[1]}" if size else ""),
        ),
    ]
    return facts, (int(size[0]), int(size[1])) if size else config.default_box


def _cmd_inspect(args: argparse.Namespace) -> int:
    target = _inspect_target(args.model)
    facts: list[tuple[str, str]] = []
    default_size = target.arch.native_size
    if target.path is not None:
        facts, default_size = _usage_facts(target.path)
    size = args.size or default_size
    requested = cost_report(target.arch, size[0], size[1], params=target.params)  # validates the size
    reports = cost_reports(target.arch, standard_sizes(target.arch, include=size), params=target.params)
    if args.json:
        print(json.dumps({**_inspect_json(target, requested, reports), "usage": dict(facts)}, indent=2))
    else:
        print(_describe(target, requested))
        width = max((len(key) for key, _ in facts), default=0)
        for key, value in facts:
            print(f"  {key.ljust(max(width, 13))}  {value}")
        print()
        print(format_cost_table(reports, target.name, requested=args.size))  # "*" only for a given --size
    return 0


# --------------------------------------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------------------------------------

SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand(
        help="serve embeddings over HTTP (POST /v1/embed, OpenAI-compatible /v1/embeddings)",
        configure=configure_serve,
        run=run_serve,
    ),
    "inspect": Subcommand(
        help="architecture, parameter count and the cost of input sizes (tokens, GFLOPs, attention)",
        configure=_configure_inspect,
        run=_cmd_inspect,
    ),
    "embed-catalog": Subcommand(
        help="embed a folder or manifest of images into resumable Parquet shards (local or Ray)",
        configure=configure_embed_catalog,
        run=run_embed_catalog,
    ),
    "index": Subcommand(
        help="similar-item index (LanceDB) from vit_backbone.catalogs: build, add (upsert by id), delete",
        configure=configure_index,
        run=run_index,
    ),
    "dedup": Subcommand(help=DEDUP_HELP, configure=configure_dedup, run=run_dedup),
    "search": Subcommand(
        help="top-k similar items of an index for query images or a vector",
        configure=configure_search,
        run=run_search,
    ),
    "eval": Subcommand(
        help="quality evaluations: retrieval (Fashion-MNIST R@1, R@10, mAP through LanceDB)",
        configure=configure_eval,
        run=run_eval,
    ),
    "heads": Subcommand(
        help="frozen heads (linear probe, kNN, per-patch) on a backbone's features: train, predict, show",
        configure=configure_heads,
        run=run_heads,
    ),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vitembed")
    except PackageNotFoundError:  # run from a clone without installing it
        return "0.1.0 (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Pretrained ViT-family backbone features: library, CLI, service.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        command.configure(commands.add_parser(name, help=command.help, description=command.help))
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vitembed`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        if exc.usage and "unrecognized arguments" in str(exc):  # which options the subcommand does take
            print(exc.usage, file=sys.stderr)
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help printed its text
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return SUBCOMMANDS[args.command].run(args)
    except BrokenPipeError:  # `vitembed inspect ... | head`: stop quietly, as Unix tools do
        _silence_stdout()
        return 1
    except (VitEmbedError, OSError, SettingsError) as exc:
        print(f"{PROG} {args.command}: error: {cli_words(_one_line(exc))}", file=sys.stderr)
        return EXIT_SERVER if getattr(exc, "code", None) == "server_error" else EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
