"""The options several commands share, spelled and parsed one way everywhere:

* ``--layers``: ``8``, ``-4 -3 -2 -1`` or ``-4,-3,-2,-1`` (both forms on every command);
* ``--size``: ``256`` (a square), ``256 320``, ``256x320`` or ``256,320`` (height then width);
* ``--k``: the result count (``--top-k`` is accepted as an alias);
* ``--device``: ``auto`` by default (CUDA when available, else the CPU);
* ``--server URL`` and ``--api-key``: embed on a running ``vitembed serve`` (``search``, ``heads predict``,
  ``embed-catalog``); the key defaults to ``$VITEMBED_API_KEY``, the variable ``serve`` reads.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from typing import Any

DEFAULT_DEVICE = "auto"
DEVICE_HELP = "cpu | cuda | auto (auto: CUDA when available, else the CPU)"
API_KEY_ENV = "VITEMBED_API_KEY"

# argparse reads "-4,-3,-2,-1" as an unknown option (only "-4" looks like a number to it); parsers taking
# --layers also take comma-joined negative indices as values.
_NEGATIVE_VALUES = re.compile(r"^-\d+(,-?\d+)*$|^-\d*\.\d+$")


def layer_values(text: str) -> tuple[int, ...]:
    """One ``--layers`` value: ``8``, ``-1`` or ``-4,-3,-2,-1`` (several values are joined)."""
    try:
        return tuple(int(part) for part in text.replace(",", " ").split())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"block indices such as 8, -4 -3 -2 -1 or -4,-3,-2,-1; got {text!r}"
        ) from exc


class _JoinLayers(argparse.Action):
    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, tuple(i for value in values for i in value) or None)


def add_layers(parser: argparse.ArgumentParser, help_text: str = "blocks (default: the model's)") -> None:
    parser.add_argument(
        "--layers",
        type=layer_values,
        nargs="+",
        action=_JoinLayers,
        default=None,
        metavar="I",
        help=f"{help_text}: 8, -4 -3 -2 -1 or -4,-3,-2,-1",
    )
    parser._negative_number_matcher = _NEGATIVE_VALUES


def parse_size(values: Sequence[str] | None) -> tuple[int, int] | None:
    """``--size`` values -> (H, W): ``256`` is a square, ``256 320`` / ``256x320`` / ``256,320`` are H, W."""
    if not values:
        return None
    parts = [p for v in values for p in str(v).lower().replace("x", " ").replace(",", " ").split()]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers = numbers * 2
    if len(numbers) != 2 or min(numbers) < 1:
        raise argparse.ArgumentTypeError(
            "--size takes 256 (a square), 'H W' or 'HxW' with positive whole numbers; "
            f"got {' '.join(values)!r}"
        )
    return numbers[0], numbers[1]


class _Size(argparse.Action):
    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        try:
            setattr(namespace, self.dest, parse_size(values))
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))


def add_size(parser: argparse.ArgumentParser, help_text: str = "input size (default: the model's)") -> None:
    parser.add_argument(
        "--size",
        nargs="+",
        action=_Size,
        default=None,
        metavar="H [W]",
        help=f"{help_text}: 256 (a square), 'H W' or 'HxW' in pixels",
    )


def add_k(parser: argparse.ArgumentParser, default: int, help_text: str) -> None:
    parser.add_argument("--k", "--top-k", dest="k", type=int, default=default, help=help_text)


def cli_words(message: str) -> str:
    """A library message in the command line's words: ``size=`` -> ``--size``, ``policy="dynamic"`` ->
    ``--policy dynamic`` (the library speaks Python keyword arguments)."""
    message = re.sub(r"""\b(policy|pooling)=['"]?(\w+)['"]?""", r"--\1 \2", message)
    return re.sub(r"\b(size|layers|policy|pooling)=(?=\s|$|[,;.)])", r"--\1", message)


def add_server(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--server URL`` and its ``--api-key`` (default: ``$VITEMBED_API_KEY``, as ``serve`` reads it)."""
    parser.add_argument("--server", metavar="URL", help=help_text)
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"with --server: the server's bearer token (default: ${API_KEY_ENV}, unset = no auth)",
    )
