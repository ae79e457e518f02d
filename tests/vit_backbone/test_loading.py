"""Checkpoint resolution and the safety rules of loading."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vit_backbone import ModelNotFoundError, UnsafeCheckpointError, UnsupportedModelError, load_backbone
from vit_backbone.checkpoint import resolve_checkpoint


def test_pickle_only_checkpoint_is_refused_unless_allowed(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = tiny_checkpoints["dinov2"]
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(src / "config.json", folder)
    shutil.copy(src / "preprocessor_config.json", folder)
    torch.save(load_file(src / "model.safetensors"), folder / "pytorch_model.bin")
    with pytest.raises(
        UnsafeCheckpointError, match=r"only pickle weights \(pytorch_model.bin\).*allow_pickle=True"
    ):
        load_backbone(folder)
    bb = load_backbone(folder, allow_pickle=True)
    reference = load_backbone(src)
    x = torch.randn(1, 3, 56, 56)
    assert torch.equal(bb.features(x).patches, reference.features(x).patches)


def test_remote_code_is_never_used(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "auto_map"
    shutil.copytree(tiny_checkpoints["dinov2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    bb = load_backbone(folder)
    assert type(bb.model).__name__ == "NativeDinov2"  # our network, never the checkpoint's auto_map
    monkeypatch.setattr("vit_backbone.loading.load_native", lambda *a, **k: None)
    assert type(load_backbone(folder).model).__name__ == "Dinov2Model"  # nor through transformers


def test_unsupported_family_and_missing_folder(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    shutil.copytree(tiny_checkpoints["dinov2"], folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="'bert' is not a supported ViT family"):
        load_backbone(folder)
    with pytest.raises(ModelNotFoundError, match="not a checkpoint folder"):
        load_backbone(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load_backbone(empty)


def test_hub_id_resolves_from_the_local_cache_offline(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-dinov2"
    shutil.copytree(tiny_checkpoints["dinov2"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolved = resolve_checkpoint("acme/tiny-dinov2")
    assert (resolved.name, resolved.revision, resolved.source) == ("acme/tiny-dinov2", commit, "hub")
    bb = load_backbone("acme/tiny-dinov2")
    assert bb.info().revision == commit
    with pytest.raises(
        ModelNotFoundError, match=r"not in the local Hugging Face cache.*hf download acme/other"
    ):
        load_backbone("acme/other")


def test_local_revision_changes_with_the_weights(make_checkpoint: object) -> None:
    make = make_checkpoint  # type: ignore[assignment]
    a = resolve_checkpoint(make("dinov2", seed=1))  # type: ignore[operator]
    b = resolve_checkpoint(make("dinov2", seed=2))  # type: ignore[operator]
    assert a.revision.startswith("local-") and a.revision != b.revision
    assert resolve_checkpoint(a.path).revision == a.revision


def test_import_loads_no_web_framework() -> None:
    code = (
        "import sys, vit_backbone; vit_backbone.load_backbone; import vit_backbone.backbone;"
        "web = ('fastapi', 'uvicorn', 'starlette', 'service');"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in web);"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
