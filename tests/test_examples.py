"""The examples in examples/ run as documented and do what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_own_head_learns_shapes_on_frozen_features(embedded_dir: Path) -> None:
    """A user's own MLP on frozen embedded-backbone features: far above chance on a shape-only task."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "examples/own_head.py", "--train", "90", "--test", "60"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"^test accuracy: (\d\.\d{3}) \(chance 0\.333, 60 test images\)$", proc.stdout, re.M)
    assert match, proc.stdout
    assert float(match.group(1)) >= 0.8, proc.stdout
    assert "features: 768 per image" in proc.stdout  # CLS + mean patch of a 384-wide ViT-S
