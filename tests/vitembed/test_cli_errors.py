"""The first mistakes a user makes on the command line: one line on stderr (after the subcommand's usage for
an unknown option), exit status 2, and a suggestion when the mistake is a near miss."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vitembed.cli.main import main


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    """Run ``vitembed argv``; it must exit 2 with no output and no traceback. Returns stderr's lines."""
    capsys.readouterr()
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "Traceback" not in out.err
    return out.err.strip().splitlines()


# ------------------------------------------------------------------------------------- serve --model


def test_serve_model_typo_suggests_embedded(capsys: pytest.CaptureFixture[str]) -> None:
    lines = usage_error(capsys, ["serve", "--model", "embeded"])
    assert lines == [
        "vitembed serve: error: --model embeded=embeded: model 'embeded' is not 'embedded', a local "
        "checkpoint folder or a hub id (hub ids look like 'owner/name', e.g. 'facebook/dinov2-small'); "
        "did you mean 'embedded'?"
    ]


def test_serve_bare_repository_name_gets_the_hub_id_shape(capsys: pytest.CaptureFixture[str]) -> None:
    (line,) = usage_error(capsys, ["serve", "--model", "dinov2-small"])
    assert "hf download" not in line  # a bare name is no hub id: no download command for it
    assert line.endswith(
        "(hub ids look like 'owner/name', e.g. 'facebook/dinov2-small'); "
        "did you mean 'facebook/dinov2-small'?"
    )


def test_serve_uncached_hub_id_offline_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    (line,) = usage_error(capsys, ["serve", "--model", "dino=acme/not-cached-anywhere"])
    assert line.startswith(
        "vitembed serve: error: --model dino=acme/not-cached-anywhere: model 'acme/not-cached-anywhere' "
        "is not a local folder and is not in the local Hugging Face cache"
    )
    assert "hf download acme/not-cached-anywhere" in line
    assert "did you mean" not in line  # a well-formed id is not second-guessed


def test_serve_folder_typo_suggests_the_sibling(capsys: pytest.CaptureFixture[str], tiny_path: Path) -> None:
    typo = str(tiny_path) + "x"
    (line,) = usage_error(capsys, ["serve", "--model", f"t={typo}"])
    assert line == (
        f"vitembed serve: error: --model t={typo}: {typo} is not a checkpoint folder (expected a folder "
        f"with config.json); did you mean {str(tiny_path)!r}?"
    )


def test_serve_missing_head_and_index_are_one_line(
    capsys: pytest.CaptureFixture[str], tiny_path: Path, tmp_path: Path
) -> None:
    (line,) = usage_error(capsys, ["serve", "--model", f"t={tiny_path}", "--head", f"h={tmp_path / 'nope'}"])
    assert line == (
        f"vitembed serve: error: no head at {tmp_path / 'nope'}/head.safetensors "
        "(expected HEAD.safetensors + HEAD.json, or a folder)"
    )
    (line,) = usage_error(capsys, ["serve", "--model", f"t={tiny_path}", "--index", f"i={tmp_path / 'db'}:t"])
    assert line == (
        f"vitembed serve: error: --index i={tmp_path / 'db'}:t: LanceDB database {tmp_path / 'db'} does not "
        "exist; create it with `vitembed index build`"
    )


# --------------------------------------------------------------------------------- unknown options

SUBCOMMANDS = [
    (["serve"], "--max-batch-sise", "--max-batch-size"),
    (["inspect", "vit-b16"], "--jsn", "--json"),
    (["embed-catalog", "folder", "--out", "o"], "--normalise", "--normalize"),
    (["index", "build", "c", "--db", "d", "--table", "t"], "--overwite", "--overwrite"),
    (["index", "add", "c", "--db", "d", "--table", "t"], "--dbb", "--db"),
    (["index", "delete", "--db", "d", "--table", "t"], "--were", "--where"),
    (["search", "--db", "d", "--table", "t", "q.jpg"], "--exakt", "--exact"),
    (["dedup", "catalog"], "--treshold", "--threshold"),
    (["eval", "retrieval"], "--pooling-x", "--pooling"),
    (["heads", "train", "--data", "d", "--out", "o"], "--val-fractoin", "--val-fraction"),
    (["heads", "predict", "h", "img.jpg"], "--top-kk", "--top-k"),
    (["heads", "show", "h"], "--jsonn", "--json"),
]


@pytest.mark.parametrize(("argv", "typo", "meant"), SUBCOMMANDS, ids=[typo for _, typo, _ in SUBCOMMANDS])
def test_unknown_option_shows_usage_and_the_nearest_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], typo: str, meant: str
) -> None:
    lines = usage_error(capsys, [*argv, typo])
    nested = argv[0] in {"index", "eval", "heads"}  # commands with actions: the action's usage
    prog = "vitembed " + " ".join(argv[:2] if nested else argv[:1])
    assert lines[0].startswith(f"usage: {prog} ")
    assert lines[-1] == f"{prog}: error: unrecognized arguments: {typo}; did you mean {meant}?"


def test_unknown_option_wins_over_a_missing_required_one(capsys: pytest.CaptureFixture[str]) -> None:
    lines = usage_error(capsys, ["embed-catalog", "folder", "--normalise"])  # --out is missing too
    assert lines[-1] == (
        "vitembed embed-catalog: error: unrecognized arguments: --normalise; did you mean --normalize?"
    )


def test_other_usage_errors_stay_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert usage_error(capsys, ["inspect", "vit-b16", "--json", "--size", "x", "y"]) == [
        "vitembed inspect: error: --size takes 256 (a square), 'H W' or 'HxW' with positive whole numbers; "
        "got 'x y'"
    ]
    assert usage_error(capsys, ["search", "--db", "d", "--table", "t", "--k", "many"]) == [
        "vitembed search: error: argument --k/--top-k: invalid int value: 'many'"
    ]


def test_serve_makes_openmp_threads_wait_passively(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set before anything imports torch (the setting fails validation after it)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    usage_error(capsys, ["serve", "--max-batch-size", "0"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the operator's choice is kept
    usage_error(capsys, ["serve", "--max-batch-size", "0"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
