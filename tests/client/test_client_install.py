"""The client installs on its own: in a fresh virtual environment (no system site packages) with only
``pip install ./client`` (its dependencies httpx and numpy come from the package index), importing it and
building a client loads neither torch, transformers nor fastapi."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import sys
import vitembed_client
client = vitembed_client.Client("http://127.0.0.1:9")
client.close()
heavy = ("torch", "transformers", "fastapi", "starlette", "PIL", "vitembed")
heavy = sorted(m for m in heavy if m in sys.modules)
print("loaded:", heavy)
print("from:", vitembed_client.__file__)
"""
NO_INDEX = ("Could not find a version", "No matching distribution", "Failed to establish a new connection")


def test_the_client_installs_and_imports_without_torch_transformers_or_fastapi(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python = env_dir / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    source = tmp_path / "client"  # a copy: the build leaves nothing in the repository
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT / "client", source, ignore=skip)
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if install.returncode != 0 and any(marker in install.stderr for marker in NO_INDEX):
        pytest.skip(f"no package index reachable for httpx and numpy: {install.stderr.strip()[-300:]}")
    assert install.returncode == 0, install.stderr
    torch_there = subprocess.run([str(python), "-c", "import torch"], capture_output=True, timeout=60)
    assert torch_there.returncode != 0  # the environment really is without torch
    out = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout
    assert str(env_dir) in out.stdout  # the installed copy, not the repository's
