"""`vitembed --version`, a description for every (sub)command, the default of every option in its help, and
VITEMBED_* variables in `serve --help`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from importlib.metadata import version

import pytest
from vitembed.cli.main import build_parser, main
from vitembed.cli.serve import env_name
from vitembed.settings import ServiceSettings


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every (sub)command's words, depth first: ("serve",), ("index", "build"), ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from commands(sub, (*path, name))


def sub_parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in words:
        [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[word]
    return parser


ALL = list(commands(build_parser()))


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"vitembed {version('vitembed')}"


def test_the_command_tree_is_complete() -> None:
    for words in [("index", "build"), ("index", "add"), ("index", "delete"), ("heads", "train"),
                  ("heads", "predict"), ("heads", "show"), ("eval", "retrieval"), ("serve",)]:  # fmt: skip
        assert words in ALL


@pytest.mark.parametrize("words", ALL, ids=" ".join)
def test_every_command_has_a_description_and_every_default_is_shown(words: tuple[str, ...]) -> None:
    parser = sub_parser(words)
    assert parser.description and len(parser.description) > 10
    text = parser.format_help()
    assert parser.description.split()[0] in text.split("\n\n")[1]  # printed right below the usage
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        shown = parser.formatter_class(parser.prog)._get_help_string(action)  # type: ignore[attr-defined]
        has_default = action.default not in (None, False, [], argparse.SUPPRESS)
        if has_default:
            assert "default" in shown, f"{' '.join(words)} {action.option_strings[0]}: {shown!r}"
        if words == ("serve",) and action.dest not in ("model", "index", "head"):
            assert "default" in shown, f"serve {action.option_strings[0]} does not say its default"


def test_serve_help_names_every_setting_s_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for field in ServiceSettings.model_fields:
        assert f"VITEMBED_{field.upper()}" in text, field
    assert "--max-batch-size VITEMBED_MAX_BATCH_SIZE" in text and env_name("--model") == "VITEMBED_MODELS"
