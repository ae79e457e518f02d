"""Cost table: parameter counts (analytic vs published vs real models), tokens, FLOPs, size validation."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vit_backbone.costs import (
    STANDARD_ARCHS,
    Arch,
    arch_from_hf_config,
    cost_report,
    cost_reports,
    count_params,
    count_params_from_safetensors,
    format_cost_table,
    forward_flops,
    read_safetensors_header,
    standard_sizes,
)
from vit_backbone.errors import (
    InvalidOptionError,
    ModelNotFoundError,
    SizeError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)

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


# ------------------------------------------------------------------------------------------ tokens, size


def test_tokens_and_sequence() -> None:
    s14 = STANDARD_ARCHS["dinov2-s14"]
    r = cost_report(s14, 224, 224)
    assert (r.grid, r.tokens, r.seq_len) == ((16, 16), 256, 257)
    assert r.patch_dim == 14 * 14 * 3
    assert r.dim == 384
    assert r.attn_entries_per_head == 257**2
    assert r.attn_mb_per_layer == pytest.approx(6 * 257**2 * 4 / 1e6)
    native = cost_report(s14, 518, 518)
    assert (native.grid, native.tokens, native.seq_len) == ((37, 37), 1369, 1370)
    assert native.native and native.flops_vs_native == 1.0
    assert not r.native and r.flops_vs_native < 0.2

    wide = cost_report(STANDARD_ARCHS["vit-b16"], 224, 448)
    assert (wide.grid, wide.tokens, wide.seq_len) == ((14, 28), 392, 393)
    assert cost_report(STANDARD_ARCHS["dinov2-s14-reg"], 224, 224).seq_len == 256 + 5
    assert cost_report(STANDARD_ARCHS["siglip-b16"], 224, 224).seq_len == 196


def test_non_multiple_size_names_nearest_multiples() -> None:
    s14 = STANDARD_ARCHS["dinov2-s14"]
    with pytest.raises(SizeError, match=r"height 225 .* 224 or 238"):
        cost_report(s14, 225, 224)
    with pytest.raises(SizeError, match=r"width 500 .* 490 or 504"):
        cost_report(s14, 224, 500)
    with pytest.raises(SizeError, match=r"nearest multiples: 14$"):
        cost_report(s14, 10, 224)
    for bad in (0, -14):
        with pytest.raises(SizeError, match="positive"):
            cost_report(s14, bad, 224)
    assert SizeError("x").code == "invalid_size"


# ------------------------------------------------------------------------------------------------ FLOPs


def test_dinov2_s14_at_224_gflops_by_hand() -> None:
    # 2 x MACs: patch conv + 12 blocks of (4 S D^2 + 2 S^2 D + 2 S D I), S = 257, D = 384, I = 1536
    s, d, i = 257, 384, 1536
    by_hand = 2 * (256 * 588 * d + 12 * (4 * s * d * d + 2 * s * s * d + 2 * s * d * i))
    report = cost_report(STANDARD_ARCHS["dinov2-s14"], 224, 224)
    assert report.gflops * 1e9 == pytest.approx(by_hand)
    assert report.gflops == pytest.approx(12.25, abs=0.01)


def _counted_flops(model: Any, size: tuple[int, int], **kwargs: Any) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model.eval()
    model.set_attn_implementation("eager")  # SDPA on CPU is invisible to the counter
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(pixel_values=torch.randn(1, 3, *size), **kwargs)
    return int(counter.get_total_flops())


def test_dinov2_s14_flops_match_flop_counter() -> None:
    """A random-init DINOv2-S/14, run with eager attention so the score matmuls are visible to the counter."""
    import transformers as tf

    config = tf.Dinov2Config(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        patch_size=14,
        image_size=518,
    )
    arch = arch_from_hf_config(config)
    assert arch == STANDARD_ARCHS["dinov2-s14"]
    counted = _counted_flops(tf.Dinov2Model(config), (224, 224))
    assert cost_report(arch, 224, 224).gflops * 1e9 == pytest.approx(counted, rel=0.01)


FLOP_CASES = {
    # family: (config class, model class, extra config, input size, forward kwargs)
    "dinov2": ("Dinov2Config", "Dinov2Model", {"patch_size": 14, "image_size": 56}, (112, 84), {}),
    "dinov2_swiglu": (
        "Dinov2Config",
        "Dinov2Model",
        {"patch_size": 14, "image_size": 56, "use_swiglu_ffn": True},
        (56, 56),
        {},
    ),
    "dinov2_with_registers": (
        "Dinov2WithRegistersConfig",
        "Dinov2WithRegistersModel",
        {"patch_size": 14, "image_size": 56},
        (112, 112),
        {},
    ),
    "dinov3_vit": (
        "DINOv3ViTConfig",
        "DINOv3ViTModel",
        {"patch_size": 16, "image_size": 64, "num_register_tokens": 4, "intermediate_size": 128},
        (128, 64),
        {},
    ),
    "vit": (
        "ViTConfig",
        "ViTModel",
        {"patch_size": 16, "image_size": 64, "intermediate_size": 128},
        (128, 128),
        {"interpolate_pos_encoding": True},
    ),
    "clip": (
        "CLIPVisionConfig",
        "CLIPVisionModel",
        {"patch_size": 16, "image_size": 64, "intermediate_size": 128},
        (64, 64),
        {},
    ),
    "siglip": (
        "SiglipVisionConfig",
        "SiglipVisionModel",
        {"patch_size": 16, "image_size": 64, "intermediate_size": 128},
        (64, 64),
        {},
    ),
}


@pytest.mark.parametrize("case", sorted(FLOP_CASES))
def test_flops_match_flop_counter_for_every_family(case: str) -> None:
    import transformers as tf

    config_class, model_class, extra, size, kwargs = FLOP_CASES[case]
    config = getattr(tf, config_class)(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **extra)
    counted = _counted_flops(getattr(tf, model_class)(config), size, **kwargs)
    arch = arch_from_hf_config(config)
    grid = (size[0] // arch.patch[0], size[1] // arch.patch[1])
    assert forward_flops(arch, grid) == pytest.approx(counted, rel=0.01)


def test_attention_grows_with_tokens_squared() -> None:
    arch = STANDARD_ARCHS["vit-b16"]
    small, big = cost_report(arch, 224, 224), cost_report(arch, 448, 448)
    assert big.tokens == 4 * small.tokens
    assert big.attn_entries_per_head / small.attn_entries_per_head == pytest.approx(16, rel=0.02)
    assert 4 < big.gflops / small.gflops < 16


# ------------------------------------------------------------------------------------------------ table


def test_standard_sizes_round_to_patch() -> None:
    assert standard_sizes(STANDARD_ARCHS["dinov2-s14"]) == [(224, 224), (448, 448), (518, 518), (896, 896)]
    assert standard_sizes(STANDARD_ARCHS["vit-b16"], include=(224, 448)) == [
        (224, 224),
        (224, 448),
        (448, 448),
        (512, 512),
        (896, 896),
    ]


def test_format_cost_table() -> None:
    arch = STANDARD_ARCHS["dinov2-s14"]
    reports = cost_reports(arch, standard_sizes(arch, include=(224, 224)))
    table = format_cost_table(reports, "dinov2-s14", requested=(224, 224))
    lines = table.splitlines()
    assert "dinov2-s14" in lines[0]
    assert all(h in lines[1] for h in ("tokens", "GFLOPs", "attn entries"))
    row224 = next(line for line in lines if "224x224" in line)
    assert row224.startswith("*")
    assert all(cell in row224.split() for cell in ("256", "257", "12.25", "66,049"))
    row518 = next(line for line in lines if "518x518" in line)
    assert row518.startswith("n")
    assert all(cell in row518.split() for cell in ("1,369", "1,370", "1.00x", "1,876,900"))
    assert "16,785,409" in table  # 896 px: 4097^2 entries per head per layer
    # a tiny model does not print 0.00
    tiny = Arch("vit", (16, 16), 3, 32, 2, 2, 64, (4, 4), "learned")
    assert "0.00 " not in format_cost_table([cost_report(tiny, 64, 64)], "tiny")
