"""One family registry, and config.json files that omit default values.

Every family's defaults table equals its transformers config class; a checkpoint whose config.json omits the
values equal to transformers' defaults (as transformers 4.x ``save_pretrained`` writes it) loads and gives the
same features as the one with the full config; an unusable config is a ModelLoadError naming the file and the
field, before any weights load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from vit_backbone import ModelLoadError, load_backbone
from vit_backbone.architectures import arch_from_hf_config
from vit_backbone.checkpoint import load_config
from vit_backbone.specs import FAMILIES, FAMILY_NAMES, family_for, parse_config

README_FAMILIES = ("dinov2", "dinov2_registers", "dinov3", "vit", "clip", "siglip")


def test_one_registry_maps_every_model_type_to_one_public_family() -> None:
    assert FAMILY_NAMES == README_FAMILIES
    owners: dict[str, str] = {}
    for spec in FAMILIES:
        assert set(spec.dual_encoder_types) <= set(spec.model_types)
        for model_type in spec.model_types:
            assert model_type not in owners, f"{model_type} belongs to {owners[model_type]} and {spec.name}"
            owners[model_type] = spec.name
            assert family_for({"model_type": model_type}) is spec
    assert owners == {
        "dinov2": "dinov2",
        "dinov2_with_registers": "dinov2_registers",
        "dinov3_vit": "dinov3",
        "vit": "vit",
        "clip": "clip",
        "clip_vision_model": "clip",
        "siglip": "siglip",
        "siglip_vision_model": "siglip",
    }


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.name)
def test_config_defaults_equal_the_transformers_config_class(spec: Any) -> None:
    import transformers as tf

    config = getattr(tf, spec.config_class)()
    for key, value in spec.config_defaults.items():
        expected = getattr(config, key)
        if key == "pooler_output_size":  # ViT: None means the width, which transformers fills in
            assert value is None and expected == config.hidden_size
        else:
            assert value == expected and type(value) is type(expected), key
    for model_type in spec.model_types:  # the nested tower of a dual encoder has the same defaults
        whole = tf.AutoConfig.for_model(model_type).to_dict()
        tower = whole.get("vision_config", whole) if model_type in spec.dual_encoder_types else whole
        for key, value in spec.config_defaults.items():
            if key != "pooler_output_size":
                assert tower[key] == value, (model_type, key)


def test_the_issue_clip_config_reads_as_transformers_does() -> None:
    import transformers as tf

    config = {"model_type": "clip", "vision_config": {"model_type": "clip_vision_model", "patch_size": 16}}
    parsed = parse_config(config)
    assert (parsed.depth, parsed.dim, parsed.heads, parsed.patch_size, parsed.native_grid) == (
        12,
        768,
        12,
        (16, 16),
        (14, 14),
    )
    assert arch_from_hf_config(config) == arch_from_hf_config(tf.CLIPVisionConfig(patch_size=16))


@pytest.mark.parametrize("family", README_FAMILIES)
def test_minimal_config_checkpoint_gives_the_same_features(
    family: str,
    tiny_checkpoints: dict[str, Path],
    minimal_checkpoints: dict[str, Path],
    sample_images: list[Image.Image],
) -> None:
    full_path, minimal_path = tiny_checkpoints[family], minimal_checkpoints[family]
    written = json.loads((minimal_path / "config.json").read_text())
    tower = written.get("vision_config", written)
    omitted = {k for k in load_config(minimal_path).spec.config_defaults if k not in tower}
    assert {"num_channels"} <= omitted  # the file really leans on the defaults
    full, minimal = load_backbone(full_path), load_backbone(minimal_path)
    assert {k: v for k, v in minimal.info().to_dict().items() if k not in ("name", "revision")} == {
        k: v for k, v in full.info().to_dict().items() if k not in ("name", "revision")
    }
    pixel_values = torch.randn(2, 3, 4 * full.patch_size[0], 5 * full.patch_size[1])  # non-native grid
    a, b = full.features(pixel_values), minimal.features(pixel_values)
    assert torch.equal(a.patches, b.patches) and torch.equal(a.registers, b.registers)
    assert (a.cls is None and b.cls is None) or torch.equal(a.cls, b.cls)  # type: ignore[arg-type]
    assert (full.embed(sample_images[:2]) == minimal.embed(sample_images[:2])).all()


def _checkpoint_with(config: dict[str, Any], source: Path, folder: Path) -> Path:
    shutil.copytree(source, folder)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("family", "change", "field", "problem"),
    [
        ("dinov2", {"model_type": None}, "model_type", "is missing"),
        ("dinov2", {"num_hidden_layers": None}, "num_hidden_layers", "is null"),
        ("vit", {"hidden_size": "768"}, "hidden_size", "must be an integer"),
        ("dinov3", {"patch_size": [16]}, "patch_size", "must be a positive int or a pair"),
        ("dinov2", {"use_swiglu_ffn": "no"}, "use_swiglu_ffn", "must be true or false"),
        ("siglip", {"num_attention_heads": 5}, "num_attention_heads", "must divide hidden_size 32, got 5"),
        ("clip", {"vision_config": [1, 2]}, "vision_config", "must be an object"),
        ("clip", {"vision_config": {"image_size": None}}, "vision_config.image_size", "is null"),
    ],
)
def test_an_unusable_config_is_a_model_load_error_naming_file_and_field(
    family: str,
    change: dict[str, Any],
    field: str,
    problem: str,
    minimal_checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    source = minimal_checkpoints[family]
    config = json.loads((source / "config.json").read_text())
    for key, value in change.items():
        if key == "vision_config" and isinstance(value, dict):
            config[key] = {**config[key], **value}
        elif value is None and key == "model_type":
            del config[key]
        else:
            config[key] = value
    folder = _checkpoint_with(config, source, tmp_path / "broken")
    with pytest.raises(ModelLoadError) as raised:
        load_backbone(folder)
    error = raised.value
    assert (error.code, error.path, error.field) == (
        "invalid_model_config",
        str(folder / "config.json"),
        field,
    )
    assert str(error).startswith(f"{folder / 'config.json'}: field {field} {problem}"), str(error)


def test_config_that_is_not_a_json_object(tmp_path: Path, minimal_checkpoints: dict[str, Path]) -> None:
    for text, problem in (("[1]", "is not a JSON object"), ("{", "not valid JSON")):
        folder = tmp_path / f"bad{len(text)}"
        shutil.copytree(minimal_checkpoints["vit"], folder)
        (folder / "config.json").write_text(text)
        with pytest.raises(ModelLoadError, match=problem) as raised:
            load_backbone(folder)
        assert raised.value.path == str(folder / "config.json") and raised.value.field is None
