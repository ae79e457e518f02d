"""`vitembed inspect`: standard architectures, a real (tiny) checkpoint folder, and one-line usage errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vitembed.cli.main import main

from vit_backbone.specs import FAMILY_NAMES as FAMILIES

TINY: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()  # drop earlier output (save_pretrained's progress bar)
    assert main(["inspect", *argv, "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    data = json.loads(out.out)
    assert isinstance(data, dict)
    return data


def assert_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    message = out.err.strip()
    assert len(message.splitlines()) == 1, out.err
    assert "Traceback" not in out.err
    for needle in needles:
        assert needle in message
    return message


@pytest.fixture(scope="module")
def dinov2_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    import transformers as tf

    folder = tmp_path_factory.mktemp("ckpt") / "tiny-dinov2"
    model = tf.Dinov2Model(tf.Dinov2Config(**TINY, patch_size=14, image_size=56))
    model.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


# -------------------------------------------------------------------------------------------- standard


def test_inspect_standard_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "vit-b16", "--size", "224", "224")
    requested = data["requested"]
    assert (requested["height"], requested["width"]) == (224, 224)
    assert requested["grid"] == [14, 14]
    assert requested["tokens"] == 196
    assert requested["seq_len"] == 197
    assert requested["patch_dim"] == 16 * 16 * 3  # raw values per patch, before the projection to D
    assert requested["dim"] == 768
    assert all(r["patch_dim"] == 768 for r in data["reports"])
    assert requested["params"] == pytest.approx(86e6, rel=0.02)
    assert requested["gflops"] == pytest.approx(35.13, abs=0.01)
    assert requested["native"] is True
    assert data["params"] == requested["params"]
    assert data["params_source"] == "analytic"
    assert data["arch"]["family"] == "vit"
    assert data["arch"]["prefix_tokens"] == 1
    sizes = [(r["height"], r["width"]) for r in data["reports"]]
    assert sizes == [(224, 224), (448, 448), (512, 512), (896, 896)]
    tokens = [r["tokens"] for r in data["reports"]]
    assert tokens == [196, 784, 1024, 3136]


def test_inspect_standard_non_square(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "dinov2-s14-reg", "--size", "224", "448")
    assert data["requested"]["tokens"] == 512
    assert data["requested"]["seq_len"] == 517
    assert (224, 448) in [(r["height"], r["width"]) for r in data["reports"]]


def test_inspect_standard_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "dinov2-s14"]) == 0
    out = capsys.readouterr().out
    for needle in ("dinov2-s14", "family", "dinov2", "14x14", "384", "prefix tokens", "37x37", "learned"):
        assert needle in out
    assert "22,056,576" in out
    assert "raw patch dim  588 (14x14x3) -> projected to D=384" in out
    native_row = next(line for line in out.splitlines() if line.split()[1:2] == ["518x518"])
    assert native_row.startswith("n ")  # nothing requested: no "*" row
    assert "1,369" in native_row


def test_import_is_light() -> None:
    """The CLI module must not import the web framework (nor torch) at import time."""
    code = (
        "import sys, vitembed.cli.main; "
        "print(','.join(m for m in ('fastapi', 'uvicorn', 'torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ checkpoint


def test_inspect_checkpoint_folder(
    capsys: pytest.CaptureFixture[str], dinov2_folder: tuple[Path, int]
) -> None:
    folder, numel = dinov2_folder
    data = run_json(capsys, str(folder))
    assert data["params"] == numel
    assert data["params_source"] == "safetensors"
    assert data["params_analytic"] == numel
    assert data["arch"]["family"] == "dinov2"
    assert data["arch"]["patch"] == [14, 14]
    assert data["arch"]["native_grid"] == [4, 4]
    requested = data["requested"]
    # by default, the size the checkpoint's preprocessing produces (no processor config: DINOv2's 224)
    assert (requested["height"], requested["width"], requested["tokens"]) == (224, 224, 256)
    assert data["usage"]["interpolation"].startswith("transformers -> bicubic")
    assert "(family default: no processor config)" in data["usage"]["preprocess"]
    assert requested["patch_dim"] == 14 * 14 * 3
    assert requested["params"] == numel

    data = run_json(capsys, str(folder), "--size", "112", "84")
    assert data["requested"]["grid"] == [8, 6]
    assert data["requested"]["tokens"] == 48

    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "dinov2" in out and f"{numel:,}" in out and "safetensors" in out
    assert "raw patch dim  588 (14x14x3) -> projected to D=32" in out


def test_inspect_full_clip_counts_the_vision_tower(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import transformers as tf

    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    config = tf.CLIPConfig(text_config=text, vision_config={**TINY, "patch_size": 16, "image_size": 64})
    model = tf.CLIPModel(config)
    model.save_pretrained(tmp_path)
    data = run_json(capsys, str(tmp_path))
    assert data["params"] == sum(p.numel() for p in model.vision_model.parameters())
    assert data["arch"]["family"] == "clip"
    assert data["requested"]["tokens"] == 196  # CLIP's default processor: 224 px at /16


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_minimal_config_equals_full_config(
    family: str,
    capsys: pytest.CaptureFixture[str],
    tiny_checkpoints: dict[str, Path],
    minimal_checkpoints: dict[str, Path],
) -> None:
    """A config.json that omits transformers' default values describes the same model."""
    full = run_json(capsys, str(tiny_checkpoints[family]))
    minimal = run_json(capsys, str(minimal_checkpoints[family]))
    for data in (full, minimal):
        del data["model"], data["path"], data["revision"]
    assert minimal == full
    assert full["arch"]["family"] == family


def test_inspect_unusable_config_is_one_line_naming_file_and_field(
    capsys: pytest.CaptureFixture[str], minimal_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "broken-clip"
    shutil.copytree(minimal_checkpoints["clip"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = None
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(
        capsys,
        ["inspect", str(folder)],
        f"{folder / 'config.json'}: field vision_config.num_hidden_layers is null",
    )


# -------------------------------------------------------------------------------------------- errors


def test_bad_size_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    message = assert_usage_error(capsys, ["inspect", "vit-b16", "--size", "225", "224"], "224 or 240")
    assert message.startswith("vitembed inspect: error:")
    assert_usage_error(capsys, ["inspect", "vit-b16", "--size", "0", "224"], "positive")


def test_bad_size_on_checkpoint(capsys: pytest.CaptureFixture[str], dinov2_folder: tuple[Path, int]) -> None:
    assert_usage_error(capsys, ["inspect", str(dinov2_folder[0]), "--size", "50", "56"], "42 or 56")


def test_unknown_model_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_usage_error(capsys, ["inspect", "vit-b17"], "unknown model", "vit-b16")
    assert_usage_error(capsys, ["inspect", "/definitely/not/here"], "not a checkpoint folder")


def test_argparse_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(capsys, ["inspect", "vit-b16", "--size", "a", "224"], "--size takes 256 (a square)")
    assert_usage_error(capsys, ["inspect"], "MODEL")
    assert_usage_error(capsys, ["frobnicate"], "invalid choice")
    assert main([]) == 2  # no subcommand: help on stderr
    assert "inspect" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ console script


def _console_script() -> str | None:
    beside = Path(sys.executable).parent / "vitembed"
    return str(beside) if beside.is_file() else shutil.which("vitembed")


def test_console_script() -> None:
    script = _console_script()
    if script is None:
        pytest.skip("the `vitembed` console script is not installed (pip install -e . --no-deps)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [script, "inspect", "dinov2-s14", "--size", "224", "224", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    requested = json.loads(done.stdout)["requested"]
    assert requested["tokens"] == 256
    assert requested["gflops"] == pytest.approx(12.25, abs=0.01)
    bad = subprocess.run(
        [script, "inspect", "dinov2-s14", "--size", "225", "224"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("vitembed inspect: error:")
    assert "224 or 238" in lines[0]
