"""Architectures and parameter counts: analytic vs published vs real models, config reading, safetensors."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vit_backbone.architectures import (
    STANDARD_ARCHS,
    Arch,
    arch_from_hf_config,
    count_params,
)
from vit_backbone.errors import (
    InvalidOptionError,
    ModelNotFoundError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from vit_backbone.safetensors_io import count_params_from_safetensors, read_safetensors_header

TINY: dict[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}


def numel(module: Any) -> int:
    return int(sum(p.numel() for p in module.parameters()))


# ---------------------------------------------------------------------------------------------- published


# Published backbone sizes (classifier heads and ViT's pooler excluded). Where a paper rounds coarsely the
# precise figure from the model card is used: DINOv2 S 22.06M (paper: 21M), L 304M (300M), g 1.14B (1.1B).
PUBLISHED = {
    "vit-s16": 22e6,
    "vit-b16": 86e6,
    "vit-l16": 307e6,
    "vit-h14": 632e6,
    "dinov2-s14": 22.06e6,
    "dinov2-b14": 86e6,
    "dinov2-l14": 304e6,
    "dinov2-g14": 1.14e9,
    "dinov2-s14-reg": 22.06e6,
    "dinov2-g14-reg": 1.14e9,
    "dinov3-b16": 86e6,
    "dinov3-l16": 300e6,
    "clip-b16": 86e6,
    "clip-l14": 304e6,
}


@pytest.mark.parametrize(("name", "published"), sorted(PUBLISHED.items()))
def test_standard_counts_match_published_within_2_percent(name: str, published: float) -> None:
    assert count_params(STANDARD_ARCHS[name]) == pytest.approx(published, rel=0.02)


def test_coarse_published_dinov2_l_figure_is_also_within_2_percent() -> None:
    assert count_params(STANDARD_ARCHS["dinov2-l14"]) == pytest.approx(300e6, rel=0.02)


def test_dinov2_giant_uses_swiglu_with_4096_hidden() -> None:
    giant = STANDARD_ARCHS["dinov2-g14"]
    assert (giant.dim, giant.depth, giant.heads) == (1536, 40, 24)
    assert giant.mlp_kind == "swiglu"
    assert giant.mlp_dim == 4096  # int(2/3 * 4 * 1536) rounded up to a multiple of 8
    assert giant.native_grid == (37, 37)
    assert giant.native_size == (518, 518)


def test_standard_arch_shapes() -> None:
    assert STANDARD_ARCHS["dinov2-b14-reg"].prefix_tokens == 5
    assert STANDARD_ARCHS["dinov3-s16"].prefix_tokens == 5
    assert STANDARD_ARCHS["dinov3-s16"].pos_embed == "rope"
    assert STANDARD_ARCHS["siglip-b16"].prefix_tokens == 0
    assert STANDARD_ARCHS["vit-b16"].has_pooler is False  # published ViT counts exclude it
    # the pooler adds exactly one D x D dense layer
    b16 = STANDARD_ARCHS["vit-b16"]
    with_pooler = dataclasses.replace(b16, has_pooler=True)
    assert count_params(with_pooler) - count_params(b16) == 768 * 768 + 768


# ---------------------------------------------------------------------------------- exact, real models


def _dinov2(tf: Any, **kw: Any) -> tuple[Any, Any]:
    config = tf.Dinov2Config(**TINY, patch_size=14, image_size=56, **kw)
    return config, tf.Dinov2Model(config)


def _case_dinov2(tf: Any) -> tuple[Any, Any]:
    return _dinov2(tf)


def _case_dinov2_swiglu(tf: Any) -> tuple[Any, Any]:
    return _dinov2(tf, use_swiglu_ffn=True)


def _case_dinov2_no_mask_token(tf: Any) -> tuple[Any, Any]:
    return _dinov2(tf, use_mask_token=False)


def _case_dinov2_registers(tf: Any) -> tuple[Any, Any]:
    config = tf.Dinov2WithRegistersConfig(**TINY, patch_size=14, image_size=56, num_register_tokens=4)
    return config, tf.Dinov2WithRegistersModel(config)


def _case_dinov3(tf: Any) -> tuple[Any, Any]:
    config = tf.DINOv3ViTConfig(
        **TINY, intermediate_size=64, patch_size=16, image_size=64, num_register_tokens=4
    )
    return config, tf.DINOv3ViTModel(config)


def _case_dinov3_gated(tf: Any) -> tuple[Any, Any]:
    config = tf.DINOv3ViTConfig(
        **TINY, intermediate_size=64, patch_size=16, image_size=64, num_register_tokens=2, use_gated_mlp=True
    )
    return config, tf.DINOv3ViTModel(config)


def _case_vit_pooler(tf: Any) -> tuple[Any, Any]:
    config = tf.ViTConfig(**TINY, intermediate_size=64, patch_size=16, image_size=64)
    return config, tf.ViTModel(config, add_pooling_layer=True)


def _case_vit_classifier(tf: Any) -> tuple[Any, Any]:
    # ViTForImageClassification builds its backbone without the pooler; `architectures` says so.
    config = tf.ViTConfig(
        **TINY,
        intermediate_size=64,
        patch_size=16,
        image_size=64,
        architectures=["ViTForImageClassification"],
    )
    return config, tf.ViTForImageClassification(config).vit


def _case_clip_vision(tf: Any) -> tuple[Any, Any]:
    config = tf.CLIPVisionConfig(**TINY, intermediate_size=64, patch_size=16, image_size=64)
    return config, tf.CLIPVisionModel(config)


def _case_clip_full(tf: Any) -> tuple[Any, Any]:
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    vision = {**TINY, "intermediate_size": 64, "patch_size": 16, "image_size": 64}
    config = tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return config, tf.CLIPModel(config).vision_model  # visual_projection is not part of the backbone


def _case_siglip_vision(tf: Any) -> tuple[Any, Any]:
    config = tf.SiglipVisionConfig(**TINY, intermediate_size=64, patch_size=16, image_size=64)
    return config, tf.SiglipVisionModel(config)


def _case_siglip_no_head(tf: Any) -> tuple[Any, Any]:
    config = tf.SiglipVisionConfig(
        **TINY, intermediate_size=64, patch_size=16, image_size=64, vision_use_head=False
    )
    return config, tf.SiglipVisionModel(config)


def _case_siglip_full(tf: Any) -> tuple[Any, Any]:
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    vision = {**TINY, "intermediate_size": 64, "patch_size": 16, "image_size": 64}
    config = tf.SiglipConfig(text_config=text, vision_config=vision)
    return config, tf.SiglipModel(config).vision_model


CASES: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "dinov2": _case_dinov2,
    "dinov2_swiglu": _case_dinov2_swiglu,
    "dinov2_no_mask_token": _case_dinov2_no_mask_token,
    "dinov2_with_registers": _case_dinov2_registers,
    "dinov3_vit": _case_dinov3,
    "dinov3_vit_gated": _case_dinov3_gated,
    "vit_with_pooler": _case_vit_pooler,
    "vit_classifier_backbone": _case_vit_classifier,
    "clip_vision": _case_clip_vision,
    "clip_full_config": _case_clip_full,
    "siglip_vision": _case_siglip_vision,
    "siglip_vision_no_head": _case_siglip_no_head,
    "siglip_full_config": _case_siglip_full,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_analytic_count_equals_real_model(case: str) -> None:
    import transformers as tf

    config, model = CASES[case](tf)
    expected = numel(model)
    assert count_params(arch_from_hf_config(config)) == expected
    # the same from config.json as written to disk (a plain mapping, JSON round trip)
    assert count_params(arch_from_hf_config(json.loads(config.to_json_string()))) == expected


def test_vit_pooler_override() -> None:
    import transformers as tf

    config = tf.ViTConfig(**TINY, intermediate_size=64, patch_size=16, image_size=64)
    without = tf.ViTModel(config, add_pooling_layer=False)
    assert count_params(arch_from_hf_config(config, has_pooler=False)) == numel(without)
    assert arch_from_hf_config(config).has_pooler is True  # ViTModel's default


@pytest.mark.parametrize(
    ("model_type", "config_class"),
    [
        ("vit", "ViTConfig"),
        ("dinov2", "Dinov2Config"),
        ("dinov2_with_registers", "Dinov2WithRegistersConfig"),
        ("dinov3_vit", "DINOv3ViTConfig"),
        ("clip_vision_model", "CLIPVisionConfig"),
        ("clip", "CLIPConfig"),
        ("siglip_vision_model", "SiglipVisionConfig"),
        ("siglip", "SiglipConfig"),
    ],
)
def test_sparse_config_json_reads_transformers_defaults(model_type: str, config_class: str) -> None:
    import transformers as tf

    assert arch_from_hf_config({"model_type": model_type}) == arch_from_hf_config(getattr(tf, config_class)())


def test_unsupported_configs() -> None:
    with pytest.raises(UnsupportedModelError, match="bert"):
        arch_from_hf_config({"model_type": "bert"})
    with pytest.raises(UnsupportedModelError):
        arch_from_hf_config({})
    with pytest.raises(UnsupportedModelError, match="patch_size"):
        arch_from_hf_config({"model_type": "vit", "patch_size": "sixteen"})
    with pytest.raises(UnsupportedModelError):
        arch_from_hf_config(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="no pooler"):
        arch_from_hf_config({"model_type": "dinov2"}, has_pooler=True)


def test_arch_validation() -> None:
    with pytest.raises(InvalidOptionError, match="divisible"):
        Arch("vit", (16, 16), 3, 100, 2, 3, 64, (4, 4), "learned")
    with pytest.raises(InvalidOptionError, match="depth"):
        Arch("vit", (16, 16), 3, 32, 0, 2, 64, (4, 4), "learned")
    with pytest.raises(InvalidOptionError, match="pooler"):
        Arch("clip", (16, 16), 3, 32, 2, 2, 64, (4, 4), "learned", has_pooler=True)


# ------------------------------------------------------------------------------------------- safetensors


def test_safetensors_count_equals_model(tmp_path: Path) -> None:
    import transformers as tf

    _, model = _case_dinov2_registers(tf)
    model.save_pretrained(tmp_path)
    expected = numel(model)
    assert count_params_from_safetensors(tmp_path) == expected
    assert count_params_from_safetensors(tmp_path / "model.safetensors") == expected
    assert count_params(arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))) == expected


def test_safetensors_sharded_and_prefix(tmp_path: Path) -> None:
    import transformers as tf

    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    vision = {**TINY, "intermediate_size": 64, "patch_size": 16, "image_size": 64}
    model = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert list(tmp_path.glob("*.safetensors.index.json"))
    assert count_params_from_safetensors(tmp_path) == numel(model)
    assert count_params_from_safetensors(tmp_path, prefix="vision_model.") == numel(model.vision_model)


def test_safetensors_reads_only_the_header(tmp_path: Path) -> None:
    import transformers as tf

    _, model = _case_dinov2(tf)
    model.save_pretrained(tmp_path / "full")
    data = (tmp_path / "full" / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    headless = tmp_path / "header_only.safetensors"
    headless.write_bytes(data[: 8 + length])  # every tensor byte cut off
    assert count_params_from_safetensors(headless) == numel(model)
    assert "__metadata__" in read_safetensors_header(headless)


def test_safetensors_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        count_params_from_safetensors(tmp_path / "missing")
    with pytest.raises(ModelNotFoundError, match="no"):
        count_params_from_safetensors(tmp_path)  # an empty folder
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(UnsafeCheckpointError):
        count_params_from_safetensors(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(UnsafeCheckpointError, match="implausible"):
        count_params_from_safetensors(huge)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(UnsafeCheckpointError, match="JSON"):
        count_params_from_safetensors(garbage)
    no_shape = tmp_path / "no_shape.safetensors"
    body = json.dumps({"w": {"dtype": "F32", "data_offsets": [0, 0]}}).encode()
    no_shape.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(UnsafeCheckpointError, match="shape"):
        count_params_from_safetensors(no_shape)
