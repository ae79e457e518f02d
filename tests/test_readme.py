"""The README's commands and code cannot rot: every bash/sh/python snippet runs here, as written, in one
folder holding what a reader brings (tests/readme_workspace.py: photos, manifests, labelled folders, a local
checkpoint; the sample photos of examples/), against a real `vitembed serve` where it calls one. A snippet
that cannot run on this machine carries `<!-- readme-test: skip: KIND: reason -->` on the line before its
fence, KIND one of SKIP_KINDS; each is reported as a skipped test with its reason (`-ra`). Every
`pip install` line, run or skipped, is resolved from the clone by pip itself (a dry run against this
environment: nothing is installed).

Order is explicit: first every snippet that makes things (catalogs, the index, heads; those ending in
`vitembed serve` are started, checked for what they serve, and stopped), in README order; then, against one
server serving what they made (index `products`, head `shapes`), every snippet that calls localhost:8000."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from readme_workspace import make_readme_workspace

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
SKIP_KINDS = {  # the only reasons a snippet may not run here
    "install": "a fresh virtual environment (its pip line is resolved by test_install_lines_resolve)",
    "cluster": "a Ray or Kubernetes cluster",
    "podman": "building or running container images (deploy/test_image.py does)",
    "bench": "a benchmark or evaluation of minutes",
    "gpu": "a GPU",
}
SERVER = re.compile(r"(localhost|127\.0\.0\.1):8000")


def test_quickstart_has_two_commands_and_ci_runs_the_test_command() -> None:
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, flags=re.S)
    assert len(commands) == 2
    assert all("\n" not in c for c in commands)
    assert "vitembed" in commands[0] and "pytest" in commands[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci_lines


# --------------------------------------------------------------------------------- the snippets
@dataclass(frozen=True)
class Snippet:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip: tuple[str, str] | None  # (kind, reason) of its skip tag, or None: the test runs it

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.language}"

    @property
    def commands(self) -> list[str]:
        """Shell lines without comments or blanks."""
        return [
            c
            for c in (line.split(" #", 1)[0].strip() for line in self.code.splitlines())
            if c and c[0] != "#"
        ]

    @property
    def serves(self) -> bool:
        """A shell snippet whose last command is `vitembed serve`: it runs until stopped."""
        return (
            self.language != "python"
            and bool(self.commands)
            and self.commands[-1].startswith("vitembed serve")
        )

    @property
    def calls_server(self) -> bool:
        return not self.serves and SERVER.search(self.code) is not None


def snippets() -> list[Snippet]:
    """Every bash, sh and python block of the README, with its skip tag (the line before its fence)."""
    found, lines = [], README.splitlines(keepends=True)
    index = 0
    while index < len(lines):
        fence = re.match(r"^```(\w*)\n$", lines[index])
        if fence is None:
            index += 1
            continue
        end = next(j for j in range(index + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) in ("bash", "sh", "python"):
            before = lines[index - 1] if index else ""
            tag = re.match(r"<!-- readme-test: skip: (\w+): (.+?) -->\n$", before)
            code = "".join(lines[index + 1 : end])
            skip = (tag.group(1), tag.group(2)) if tag else None
            found.append(Snippet(index + 1, fence.group(1), code, skip))
        index = end + 1
    return found


def test_every_snippet_runs_or_says_why_not() -> None:
    every = snippets()
    assert len(every) >= 20
    fences = set(re.findall(r"^```(\w+)$", README, flags=re.M))
    assert fences <= {"bash", "sh", "python"}, f"code blocks in a language this test does not run: {fences}"
    tags = re.findall(r"^<!-- readme-test.*$", README, flags=re.M)
    assert len(tags) == sum(s.skip is not None for s in every), (
        f"a tag not on the line before a fence: {tags}"
    )
    skipped = [s for s in every if s.skip is not None]
    print(f"README snippets: {len(every) - len(skipped)} run, {len(skipped)} skipped here:")  # shown with -s
    for snippet in skipped:
        kind, reason = snippet.skip or ("", "")
        print(f"  README.md:{snippet.line} ({snippet.language}) {kind}: {reason}")
        assert kind in SKIP_KINDS, (
            f"README.md:{snippet.line}: skip kind {kind!r} is not one of {sorted(SKIP_KINDS)}"
        )
        assert len(reason) > 10, f"README.md:{snippet.line}: a skip tag needs its reason"
        if kind == "install":
            assert any(c.startswith("pip install") for c in _pip_commands(snippet)), snippet.line
    assert len(skipped) <= 8, "more snippets skipped than the clusters, images, benches and fresh installs"


def test_files_the_snippets_name_exist() -> None:
    for snippet in snippets():
        for name in re.findall(r"examples/[\w./-]+\.(?:jpg|png|py)", snippet.code):
            assert (ROOT / name).is_file(), f"README.md:{snippet.line} names {name}, which is not shipped"


# --------------------------------------------------------------------------------- pip lines
def _pip_commands(snippet: Snippet) -> list[str]:
    return [p.strip() for c in snippet.commands for p in c.split("&&") if p.strip().startswith("pip install")]


def test_extras_the_readme_names_exist() -> None:
    """Every `.[extra,...]` the README names (in snippets or prose) is an extra of pyproject.toml."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, flags=re.M))
    named = {e.strip() for group in re.findall(r"\.\[([\w, -]+)\]", README) for e in group.split(",")}
    assert named and named <= extras, f"README names extras pyproject.toml lacks: {named - extras}"


PIP = f"""#!/bin/sh
# README snippets' `pip install ...`: resolved by pip (a dry run against this environment), never installed
[ "$1" = install ] || {{ echo "README snippets call only 'pip install'" >&2; exit 2; }}
shift
out=$("{sys.executable}" -m pip install --dry-run --no-build-isolation "$@" 2>&1); status=$?
printf '%s\\n' "$out"
case "$out" in *"does not provide the extra"*) exit 3;; esac
exit $status
"""


@pytest.fixture(scope="module")
def pip_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bin")
    (folder / "pip").write_text(PIP)
    (folder / "pip").chmod(0o755)
    return folder


def test_install_lines_resolve(pip_shim: Path) -> None:
    """Every `pip install` line of every snippet (the skipped fresh-venv ones too) works from a clone: pip
    reads the local projects and extras and finds every requirement (already installed here)."""
    lines = [(s.line, c) for s in snippets() for c in _pip_commands(s)]
    assert len(lines) >= 4
    for line, command in lines:
        done = subprocess.run(
            [str(pip_shim / "pip"), *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, (
            f"README.md:{line}: {command}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
        )


# --------------------------------------------------------------------------------- running them
@dataclass(frozen=True)
class Check:
    """What a snippet must print: regexes over its stdout (an epilogue, appended to the README's code when
    it runs, prints values the snippet computes but does not show)."""

    expect: list[str]
    epilogue: str = ""


# key: a piece of text found in exactly one snippet
CHECKS = {
    "pip install ./client": Check([r'"dim": ?768', r"Would install vitembed-client-"]),
    'client.embed(["examples/cat.jpg", "examples/coffee.jpg"], normalize=True)': Check(
        [r"^\(2, 768\) float32 \[1\.0, 1\.0\]$"],
        "print(vectors.shape, vectors.dtype, [round(float(v), 3) for v in (vectors**2).sum(axis=1)])",
    ),
    "vitembed embed-catalog photos/ --out cat/": Check(
        [
            r"done: 3 rows written, 0 errors",
            r"table built from 3 catalog rows",
            r"trained a linear head on \d+ images \(3 classes\)",
        ]
    ),
    'pil_image = Image.open("examples/coffee.jpg")  # the two': Check(
        [r"^\(2, 768\) float32$"], "print(vectors.shape, vectors.dtype)"
    ),
    "recipe = bb.embed(photos": Check(
        [
            r"^\(1, \d+, \d+, 384\)$",
            r"^torch\.Size\(\[2, 384\]\) torch\.Size\(\[2, 16, 16, 384\]\) .* \[9, 11\]$",
        ]
    ),
    "curl -s -F image=@examples/cat.jpg -F image=@examples/coffee.jpg": Check(
        [
            r'"policy": ?"trim_squash"',
            r'"code": ?"invalid_size", ?"message": ?"policy=\'trim_squash\': the requested size 100x100',
            r"grid\.npy \(1, 16, 16, 384\) float16$",
        ],
        "python -c \"import numpy as np; a = np.load('grid.npy'); print('grid.npy', a.shape, a.dtype)\"",
    ),
    "import base64, openai": Check(
        [r"^768 1\.0$"], "print(len(vector), round(sum(v * v for v in vector), 3))"
    ),
    "RetryPolicy(deadline=60.0)": Check(
        [r"^422 invalid_size ", r"^\(3, 768\) \(1, 32, 32, 384\) sku-042 3 \['embedded'\]$"],
        "print(vectors.shape, grid.shape, hits[0].id, len(labels), [m.id for m in models])",
    ),
    "vitembed embed-catalog products.csv": Check([r"done: 3 rows written", r"done: 4 rows written"]),
    "vitembed index build catalogs/products": Check(
        [
            r"table built from 4 catalog rows",
            r"^\s+1\s+\+0\.9\d+\s+sku-042",  # the coffee product first: a crop of the query photo
            r"1 rows inserted, 1 updated",
        ]
    ),
    "-F \"where=brand = 'acme'\" localhost:8000/v1/search": Check(
        [r'"results": ?\[\{"id": ?"sku-042", ?"score": ?0\.9']
    ),
    "vitembed heads train --data shapes/": Check(
        [
            r"^trained a linear head on 24 images \(3 classes\)$",
            r"^features: 30 computed, 0 from the cache$",
            r"^validation accuracy: (1\.0000|0\.[89]\d+) \(6 held out",
            r"^saved shapes\.safetensors and shapes\.json$",
            r"validation mIoU: 0\.\d+",
            r"^trained a linear head on \d+ catalog vectors \(3 classes\)$",
        ]
    ),
    'train_head(bb, "shapes/"': Check(
        [r"^\(1, 3\) \('blue_square', 'green_triangle', 'red_circle'\)$"],
        "print(tuple(probabilities.shape), head.card.classes)",
    ),
}


def test_every_check_names_one_running_snippet() -> None:
    running = [s for s in snippets() if s.skip is None]
    for key in CHECKS:
        matches = [s.line for s in running if key in s.code]
        assert len(matches) == 1, f"CHECKS key {key!r} matches running snippets at lines {matches}"


@dataclass
class Outcome:
    status: int | None
    stdout: str
    stderr: str
    seconds: float
    served: dict[str, list[str]] = field(default_factory=dict)  # what a serving snippet served


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Workspace:
    root: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def workspace(
    embedded_dir: Path,
    make_checkpoint: Callable[..., Path],
    pip_shim: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Workspace:
    dinov2 = make_checkpoint("dinov2")
    root = make_readme_workspace(tmp_path_factory.mktemp("readme") / "work", ROOT, embedded_dir, dinov2)
    env = {
        **os.environ,
        "HOME": str(root / "home"),
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{pip_shim}:{BIN}:{os.environ['PATH']}",
    }
    return Workspace(root, env)


def _prepared(snippet: Snippet, port: int) -> list[str]:
    code = SERVER.sub(f"127.0.0.1:{port}", snippet.code).replace("--port 8000", f"--port {port}")
    check = next((c for key, c in CHECKS.items() if key in snippet.code), None)
    if check is not None and check.epilogue:
        code += "\n" + check.epilogue + "\n"
    if snippet.language == "python":
        return [sys.executable, "-c", code]
    return ["bash", "-e", "-o", "pipefail", "-c", code]


def _run(snippet: Snippet, workspace: Workspace, port: int) -> Outcome:
    start = time.monotonic()
    done = subprocess.run(
        _prepared(snippet, port),
        cwd=workspace.root,
        env=workspace.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


def _descendants(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [d for c in children for d in (*_descendants(int(c)), int(c))]


def _wait_ready(proc: subprocess.Popen[bytes], port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def _run_serving(snippet: Snippet, workspace: Workspace) -> Outcome:
    """Run a snippet that ends in `vitembed serve` until its server is ready, note what it serves, then stop
    the server with SIGTERM (a clean exit: status 0 for the whole snippet)."""
    port, start = _free_port(), time.monotonic()
    env = {**workspace.env, "VITEMBED_PORT": str(port)}
    out, err = workspace.root / f"{snippet.id}.out", workspace.root / f"{snippet.id}.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            _prepared(snippet, port),
            cwd=workspace.root,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        served: dict[str, list[str]] = {}
        try:
            if _wait_ready(proc, port, 300):
                base = f"http://127.0.0.1:{port}/v1"
                models = httpx.get(f"{base}/models", timeout=30).json()["data"]
                served["models"] = sorted(m["id"] for m in models)
                served["heads"] = sorted(name for m in models for name in m["info"]["heads"])
                served["indexes"] = sorted(
                    i["name"] for i in httpx.get(f"{base}/indexes", timeout=30).json()["data"]
                )
            for pid in _descendants(proc.pid) or [proc.pid]:
                os.kill(pid, signal.SIGTERM)
            status: int | None = proc.wait(timeout=90)
        except (subprocess.TimeoutExpired, httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            status, served["error"] = None, [repr(exc)]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return Outcome(status, out.read_text(), err.read_text(), time.monotonic() - start, served)


def _expected_served(snippet: Snippet) -> dict[str, list[str]]:
    """What the snippet's `vitembed serve` line names: models (embedded by default), indexes, heads."""
    words = shlex.split(snippet.commands[-1])
    named = {
        flag: [w.split("=", 1)[0] for f, w in itertools.pairwise(words) if f == flag]
        for flag in ("--model", "--index", "--head")
    }
    return {
        "models": sorted(named["--model"] or ["embedded"]),
        "indexes": sorted(named["--index"]),
        "heads": sorted(named["--head"]),
    }


RUN = [s for s in snippets() if s.skip is None]
MAKERS = [s for s in RUN if not s.calls_server]  # README order: the catalog before its index, ...
CALLERS = [s for s in RUN if s.calls_server]
ORDER = MAKERS + CALLERS + [s for s in snippets() if s.skip is not None]  # skipped: reported by `-ra`


@pytest.fixture(scope="module")
def made(workspace: Workspace) -> dict[int, Outcome]:
    """Every snippet that does not call a server, in README order, in the shared folder."""
    outcomes = {}
    for snippet in MAKERS:
        outcomes[snippet.line] = (
            _run_serving(snippet, workspace) if snippet.serves else _run(snippet, workspace, 0)
        )
    return outcomes


@pytest.fixture(scope="module")
def readme_server(made: dict[int, Outcome], workspace: Workspace) -> Iterator[int]:
    """A real `vitembed serve` of what the making snippets made (index `products`, head `shapes`) on a free
    port: the README's localhost:8000."""
    port = _free_port()
    root = workspace.root
    index, head = f"products={root / 'data' / 'lancedb'}:products", f"shapes={root / 'shapes.safetensors'}"
    command = ["vitembed", "serve", "--port", str(port), "--index", index, "--head", head]
    with (root / "readme-server.log").open("wb") as log:
        proc = subprocess.Popen(command, cwd=root, env=workspace.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not _wait_ready(proc, port, 300):
                log_text = (root / "readme-server.log").read_text()[-3000:]
                pytest.fail(f"the README's server did not become ready:\n{log_text}")
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", ORDER, ids=[s.id for s in ORDER])
def test_snippet_runs_as_written(snippet: Snippet, request: pytest.FixtureRequest) -> None:
    if snippet.skip is not None:
        pytest.skip(f"README.md:{snippet.line} {snippet.skip[0]}: {snippet.skip[1]}")
    if snippet.calls_server:
        outcome = _run(
            snippet, request.getfixturevalue("workspace"), request.getfixturevalue("readme_server")
        )
    else:
        outcome = request.getfixturevalue("made")[snippet.line]
    print(f"README.md:{snippet.line} ({snippet.language}): {outcome.seconds:.1f} s")
    failed = (
        f"README.md:{snippet.line}: exit status {outcome.status}\n"
        f"{outcome.stdout[-3000:]}\n{outcome.stderr[-3000:]}"
    )
    assert outcome.status == 0, failed
    if snippet.serves:
        assert outcome.served == _expected_served(snippet), failed
    check = next((c for key, c in CHECKS.items() if key in snippet.code), Check([]))
    for pattern in check.expect:
        assert re.search(pattern, outcome.stdout, flags=re.M), (
            f"README.md:{snippet.line}: no {pattern!r}\n{failed}"
        )
