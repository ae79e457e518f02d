"""Fixtures for the catalog tests: a generated image tree (good and broken files), the tiny DINOv2, and a
way to run ``vitembed embed-catalog`` in process and capture its exit status and output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from catalog_images import ImageTree, make_image_tree
from vitembed.cli.main import main

from vit_backbone import Backbone, load_backbone


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


RunCli = Callable[..., CliResult]


@pytest.fixture(scope="session")
def tree(tmp_path_factory: pytest.TempPathFactory) -> ImageTree:
    return make_image_tree(tmp_path_factory.mktemp("catalog-images") / "images")


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["dinov2"]


@pytest.fixture(scope="session")
def tiny(tiny_path: Path) -> Backbone:
    return load_backbone(tiny_path)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str], tiny_path: Path) -> RunCli:
    """``run_cli(source, out, *flags)``: embed-catalog with the tiny model in float32 unless overridden."""

    def run(source: Path | str, out: Path, *flags: str, model: str | None = None) -> CliResult:
        capsys.readouterr()
        argv = ["embed-catalog", str(source), "--out", str(out), "--model", model or str(tiny_path)]
        if "--precision" not in flags:
            argv += ["--precision", "float32"]
        code = main([*argv, *flags])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
