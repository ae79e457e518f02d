"""The wheel installs only the project's own import names, and the installed command runs.

The wheel is built from a copy of the sources (nothing is written into the repository) with the current
interpreter's setuptools and no build isolation, so it needs no index; it is installed NOT editable into a
fresh venv made with ``--without-pip`` (the test's pip installs into it: ``pip --python``), with
``--no-deps``. Offline and fast (~10 s): nothing is downloaded. The venv gets only what ``vitembed --help``
needs besides the wheel: numpy (a core dependency: ``dedup``'s defaults live beside its numpy code), linked
from the test's own environment. Not ``--system-site-packages``: that exposes the base interpreter's
packages, not this environment's, and would hide a missing one. Commands run there from an empty folder
with no ``PYTHONPATH``, so nothing can be imported from this checkout. That holds ``vitembed --help`` to
what its module promises: no torch, no transformers, nothing of the ``service`` extra (pydantic, FastAPI):
the heavy imports are inside the subcommands, so a plain ``pip install vitembed`` can ask for help.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from source_tree import ROOT, copy_sources

SOURCES = ["pyproject.toml", "README.md", "vit_backbone", "service"]
PIP = (sys.executable, "-m", "pip")
HELP_NEEDS = ("numpy",)  # distributions besides the wheel that `vitembed --help` imports
SUBCOMMANDS = ("serve", "inspect", "embed-catalog", "index", "dedup", "search", "eval", "heads")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no PYTHONPATH & co.
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [*PIP, "-q", *(str(arg) for arg in args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the venv it is installed in)."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("packaging")
    src = copy_sources(SOURCES, tmp / "src")
    dist = tmp / "dist"
    build = _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--check-build-dependencies",
        "-w",
        dist,
        src,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = dist.glob("vitembed-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    install = _pip("--python", venv / "bin" / "python", "install", "--no-deps", "--no-index", wheel)
    assert install.returncode == 0, install.stdout + install.stderr
    [site_packages] = (venv / "lib").glob("python*/site-packages")
    for name in HELP_NEEDS:
        dist = importlib.metadata.distribution(name)
        for top in {file.parts[0] for file in dist.files or () if file.parts[0] != ".."}:
            (site_packages / top).symlink_to(Path(str(dist.locate_file(top))))
    (tmp / "empty").mkdir()
    return wheel, venv


def test_the_wheel_installs_only_the_project_names(installed: tuple[Path, Path]) -> None:
    wheel, venv = installed
    [dist_info] = (venv / "lib").glob("python*/site-packages/vitembed-*.dist-info")
    assert set((dist_info / "top_level.txt").read_text().split()) == {"vit_backbone", "vitembed"}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"vit_backbone", "vitembed"}
    # every module and every file of the explorer page ships, under its import name
    expected = {
        f"vit_backbone/{p.relative_to(ROOT / 'vit_backbone').as_posix()}" for p in _files("vit_backbone")
    }
    expected |= {
        f"vitembed/{p.relative_to(ROOT / 'service' / 'vitembed').as_posix()}"
        for p in _files("service/vitembed")
    }
    assert expected - set(names) == set()
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "vitembed = vitembed.cli.main:main" in entry_points


def _files(folder: str) -> list[Path]:
    return [
        path
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    ]


def test_vitembed_help_runs_from_the_installed_wheel(installed: tuple[Path, Path]) -> None:
    _, venv = installed
    cwd = venv.parent / "empty"
    result = _run([str(venv / "bin" / "vitembed"), "--help"], cwd)
    assert result.returncode == 0, result.stderr
    for name in SUBCOMMANDS:
        assert name in result.stdout, f"{name!r} missing from vitembed --help:\n{result.stdout}"
    where = _run(
        [str(venv / "bin" / "python"), "-c", "import vitembed, vit_backbone; print(vitembed.__file__)"], cwd
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), (
        where.stdout
    )  # the installed copy, not the checkout


@pytest.mark.parametrize("name", ["service", "catalog"])
def test_generic_names_are_not_installed(installed: tuple[Path, Path], name: str) -> None:
    _, venv = installed
    result = _run([str(venv / "bin" / "python"), "-c", f"import {name}"], venv.parent / "empty")
    assert result.returncode == 1
    assert f"ModuleNotFoundError: No module named '{name}'" in result.stderr
