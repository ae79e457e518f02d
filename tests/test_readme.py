"""The README's commands and code cannot rot: CI runs its test command, every bash/sh/python snippet runs
here against a real server (with the sample photos in examples/), unless a skip tag before it says why not;
the skipped ones are listed."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
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


# --------------------------------------------------------------------------------- every snippet
SKIP = re.compile(r"<!-- readme-test: skip: (.+?) -->\n$")


@dataclass(frozen=True)
class Snippet:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip: str | None  # the reason of its skip tag, or None: the test runs it


def snippets() -> list[Snippet]:
    """Every bash, sh and python block of the README, with its skip tag (the line before its fence)."""
    found, lines = [], README.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(bash|sh|python)\n$", lines[index])
        if fence is None:
            index += 1
            continue
        end = next(j for j in range(index + 1, len(lines)) if lines[j].startswith("```"))
        tag = SKIP.match(lines[index - 1]) if index else None
        code = "".join(lines[index + 1 : end])
        found.append(Snippet(index + 1, fence.group(1), code, tag.group(1) if tag else None))
        index = end + 1
    return found


def test_every_snippet_runs_or_says_why_not() -> None:
    every = snippets()
    assert len(every) >= 20
    skipped = [s for s in every if s.skip is not None]
    for snippet in skipped:
        assert len(snippet.skip or "") > 10, f"README.md:{snippet.line}: a skip tag needs its reason"
    print("README snippets skipped here:")  # shown with -s: what this test does not run, and why
    for snippet in skipped:
        print(f"  README.md:{snippet.line} ({snippet.language}): {snippet.skip}")
    assert len(skipped) < len(every)


def test_files_the_snippets_name_exist() -> None:
    for snippet in snippets():
        for name in re.findall(r"examples/[\w./-]+\.(?:jpg|png|py)", snippet.code):
            assert (ROOT / name).is_file(), f"README.md:{snippet.line} names {name}, which is not shipped"
    assert "pil_image" not in "".join(s.code for s in snippets() if "pil_image =" not in s.code)


@pytest.fixture(scope="module")
def readme_server(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `vitembed serve` (the embedded default) on a free port: the README's localhost:8000."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path_factory.mktemp("readme") / "serve.log").open("wb")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "vitembed", "serve", "--port", str(port)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"vitembed serve did not become ready (exit status {proc.poll()})")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


RUN = [s for s in snippets() if s.skip is None]


@pytest.mark.slow
@pytest.mark.parametrize("snippet", RUN, ids=[f"line{s.line}-{s.language}" for s in RUN])
def test_snippet_runs_as_written(snippet: Snippet, readme_server: str, tmp_path: Path) -> None:
    """Run in a fresh folder holding the repository's examples/ (outputs such as grid.npy land there), with
    the README's localhost:8000 pointing at the test's server."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    code = re.sub(r"(localhost|127\.0\.0\.1):8000", readme_server, snippet.code)
    if snippet.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"README.md:{snippet.line} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )
