"""What commands print says what happened: `index build/add/delete` name the action and the table's state
once, `inspect` describes the preprocessing the default policy really uses and marks a requested size only
when one was requested."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vitembed.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


@pytest.fixture
def catalog(tmp_path: Path, tiny_path: Path, sample_images: list, capsys: pytest.CaptureFixture[str]) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, image in enumerate(sample_images[:3]):
        image.resize((64, 48)).save(folder / f"p{i}.jpg")
    run(
        capsys,
        "embed-catalog",
        folder,
        "--out",
        tmp_path / "cat",
        "--model",
        tiny_path,
        "--precision",
        "float32",
    )
    return tmp_path / "cat"


def test_index_messages_say_the_action_and_the_state_once(
    capsys: pytest.CaptureFixture[str], catalog: Path, tmp_path: Path
) -> None:
    db = tmp_path / "db"
    out = run(capsys, "index", "build", catalog, "--db", db, "--table", "t")
    assert out.strip() == (
        f"{db}:t: table built from 3 catalog rows; it holds 3 rows, searched exactly (no ANN index below the "
        "--ann-threshold)"
    )
    out = run(capsys, "index", "add", catalog, "--db", db, "--table", "t")
    assert out.strip().startswith(f"{db}:t: 0 rows inserted, 3 updated; it holds 3 rows, searched exactly")
    out = run(capsys, "index", "delete", "p0.jpg", "--db", db, "--table", "t")
    assert out.strip().startswith(f"{db}:t: 1 rows deleted; it holds 2 rows")


def test_inspect_shows_the_default_policy_s_preprocessing(
    capsys: pytest.CaptureFixture[str], tiny_path: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "padded"
    shutil.copytree(tiny_path, folder)
    (folder / "vitembed.json").write_text(json.dumps({"defaults": {"policy": "pad", "pooling": "mean"}}))
    out = run(capsys, "inspect", folder)
    [preprocess] = [
        line for line in out.splitlines() if line.split()[:1] == ["preprocess"] and "#" not in line
    ]
    assert "policy pad: letterbox into 56x56 (aspect kept, no crop)" in preprocess
    assert "center crop" not in preprocess
    assert "* = requested" not in out and not any(line.startswith("*") for line in out.splitlines())
    requested = run(capsys, "inspect", folder, "--size", "112")
    assert requested.rstrip().endswith("* = requested")
    assert [line.split()[1] for line in requested.splitlines() if line.startswith("*")] == ["112x112"]
    plain = run(capsys, "inspect", tiny_path)  # the processor's own pipeline: its crop is what runs
    assert "-> center crop 56x56" in plain
