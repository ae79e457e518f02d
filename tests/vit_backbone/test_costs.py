"""Cost table: tokens, FLOPs (analytic vs torch's flop counter), attention entries, size validation."""

from __future__ import annotations

from typing import Any

import pytest

from vit_backbone.architectures import STANDARD_ARCHS, Arch, arch_from_hf_config
from vit_backbone.costs import (
    cost_report,
    cost_reports,
    format_cost_table,
    forward_flops,
    standard_sizes,
)
from vit_backbone.errors import SizeError

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
