"""The README's commands and code cannot rot: CI runs its test command, and its example runs here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_quickstart_has_two_commands_and_ci_runs_the_test_command() -> None:
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, flags=re.S)
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "vitembed" in commands[0] and "pytest" in commands[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci_lines


@pytest.mark.slow
def test_readme_python_example_runs(embedded_dir: Path) -> None:
    runnable = [b for b in _blocks("python") if "assert" in b]
    assert len(runnable) == 1
    exec(compile(runnable[0], "README.md", "exec"), {})
