"""preprocess_config.py: reading processor configs with transformers' class defaults, validation, the hash."""

from __future__ import annotations

import json
from typing import Any

import pytest
import transformers as tf

from vit_backbone import preprocess, preprocess_config, specs
from vit_backbone.errors import InvalidOptionError, UnsupportedModelError
from vit_backbone.preprocess_config import PreprocessConfig

IMAGENET: dict[str, Any] = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def dinov2_processor(**overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "size": {"shortest_edge": 256},
        "crop_size": {"height": 224, "width": 224},
        "resample": 3,
    }
    return tf.BitImageProcessorPil(**(kwargs | IMAGENET | overrides))


def config_of(processor: Any) -> PreprocessConfig:
    """Through JSON, as a checkpoint's preprocessor_config.json would be read."""
    return PreprocessConfig.from_processor_dict(json.loads(processor.to_json_string()))


# --- parsing and class defaults ----------------------------------------------------------------------


def test_hub_style_configs_take_class_defaults() -> None:
    legacy_clip = {
        "crop_size": 224,
        "do_center_crop": True,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "size": 224,
        "resample": 3,
        "do_normalize": True,
        "do_resize": True,
    }
    cfg = PreprocessConfig.from_processor_dict(legacy_clip)
    assert cfg.processor_type == "CLIPImageProcessor" and cfg.resize_mode == "shortest_edge"
    assert cfg.shortest_edge == 224 and cfg.crop_size == (224, 224)
    assert cfg.image_mean == (0.48145466, 0.4578275, 0.40821073) and cfg.rescale_factor == 1 / 255
    vit = PreprocessConfig.from_processor_dict({"feature_extractor_type": "ViTFeatureExtractor", "size": 224})
    assert vit.size == (224, 224) and not vit.do_center_crop and vit.resample == 2
    assert vit.image_mean == (0.5, 0.5, 0.5)
    dinov3 = {
        "image_processor_type": "DINOv3ViTImageProcessorFast",
        "crop_size": None,
        "do_center_crop": None,
        "size": {"height": 224, "width": 224},
        "resample": 2,
        **IMAGENET,
    }
    cfg3 = PreprocessConfig.from_processor_dict(dinov3)
    assert cfg3.processor_type == "DINOv3ViTImageProcessor" and cfg3.pipeline == "torch"
    assert cfg3.output_size == (224, 224) and not cfg3.do_center_crop
    assert config_of(dinov2_processor()).pipeline == "pil"


def test_unsupported_processors_and_sizes_are_rejected() -> None:
    with pytest.raises(UnsupportedModelError, match="ConvNextImageProcessor"):
        PreprocessConfig.from_processor_dict({"image_processor_type": "ConvNextImageProcessor"})
    with pytest.raises(InvalidOptionError, match="longest_edge"):
        PreprocessConfig.from_processor_dict(
            {"image_processor_type": "BitImageProcessor", "size": {"shortest_edge": 224, "longest_edge": 400}}
        )


def test_normalisation_constants_are_defined_once() -> None:
    assert tuple(IMAGENET["image_mean"]) == preprocess_config.IMAGENET_MEAN
    assert tuple(IMAGENET["image_std"]) == preprocess_config.IMAGENET_STD
    for name in ("IMAGENET_MEAN", "IMAGENET_STD", "CLIP_MEAN", "CLIP_STD"):
        assert getattr(specs, name) is getattr(preprocess_config, name)
    assert preprocess.PreprocessConfig is PreprocessConfig  # the historical import path still works


# --- provenance --------------------------------------------------------------------------------------


def test_hash_is_stable_and_sensitive() -> None:
    a, b = config_of(dinov2_processor()), config_of(dinov2_processor())
    assert a == b and a.hash() == b.hash() and len(a.hash()) == 16
    int(a.hash(), 16)
    changed = dinov2_processor(image_mean=[0.485, 0.456, 0.407])
    assert config_of(changed).hash() != a.hash()
    loaded: dict[str, Any] = json.loads(json.dumps(a.to_dict()))
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in loaded.items()}
    rebuilt = PreprocessConfig(**fields)
    assert rebuilt == a and rebuilt.hash() == a.hash()
