"""The argument parser every ``vitembed`` command and subcommand uses.

* Its errors raise :class:`UsageError` (one line, exit status 2 in ``main``) instead of exiting; an unknown
  option names the subcommand it was given to, shows that subcommand's usage and suggests the nearest option
  (``--normalise`` -> ``did you mean --normalize?``).
* Its help shows every option's default (:class:`DefaultsFormatter`) unless the help text already says it.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn


class UsageError(Exception):
    """argparse's complaint as text (``usage`` is the subcommand's usage line, or empty)."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help when it has a default worth naming and its help does not
    already state one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or "%(default)" in text
            or default is None
            or default is argparse.SUPPRESS
            or default is False
            or default == []
            or not action.option_strings
            or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            return text
        shown = " ".join(str(v) for v in default) if isinstance(default, list | tuple) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions for name in action.option_strings if name.startswith("--")]


def suggest_option(unknown: str, options: Sequence[str]) -> str | None:
    """The option ``unknown`` most likely meant (``--normalise`` -> ``--normalize``), or None."""
    flag = unknown.split("=", 1)[0]
    if flag.startswith("-") and not flag.startswith("--"):
        flag = "-" + flag  # -normalize -> --normalize
    close = difflib.get_close_matches(flag, list(options), n=1, cutoff=0.7)
    return close[0] if close else None


class _SubParsers(argparse._SubParsersAction):
    """Every subcommand's help line is also its description (the first line of its ``--help``)."""

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if "help" in kwargs:
            kwargs.setdefault("description", kwargs["help"])
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    """See the module docstring. Subparsers (``add_subparsers``) are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsers)

    def error(self, message: str) -> NoReturn:
        unknown = self._unknown_options()
        if unknown and "unrecognized arguments" not in message:  # a typo explains the rest: say it first
            self.unrecognized(unknown)
        raise UsageError(f"{self.prog}: error: {message}", self.format_usage().strip())

    def _unknown_options(self) -> list[str]:
        """The ``--options`` of the arguments being parsed that this parser does not take (not even as an
        abbreviation), while its subcommands take no arguments of their own."""
        if self._subparsers:
            return []
        known = _option_names(self)
        flags = [arg.split("=", 1)[0] for arg in getattr(self, "_raw_args", ()) if arg.startswith("--")]
        return [flag for flag in flags if flag != "--" and not any(k.startswith(flag) for k in known)]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._raw_args = list(args) if args is not None else []
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and not self._subparsers:  # the innermost (sub)command: the options are its to refuse
            self.unrecognized(extras)
        return parsed, extras

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        unknown = [arg for arg in extras if arg.startswith("-")]
        message = f"unrecognized arguments: {' '.join(extras)}"
        for arg in unknown:
            hint = suggest_option(arg, _option_names(self))
            if hint is not None:
                message += f"; did you mean {hint}?"
                break
        self.error(message)
