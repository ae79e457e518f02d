"""The three declared resampling rules, checked against independent implementations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from vit_backbone import load_backbone
from vit_backbone.errors import UnsupportedModelError
from vit_backbone.pos_embed import PositionTableCache, resample_patch_table


def dinov2_reference_interpolation(pos_embed: torch.Tensor, h: int, w: int, patch: int) -> torch.Tensor:
    """The DINOv2 reference code's rule for models without registers, written out from its description:
    bicubic with scale_factor (n + 0.1) / M per axis, no antialias, in float32."""
    n = pos_embed.shape[1] - 1
    m = int(math.sqrt(n))
    dim = pos_embed.shape[-1]
    rows, cols = h // patch, w // patch
    grid = pos_embed[:, 1:].float().reshape(1, m, m, dim).permute(0, 3, 1, 2)
    out = F.interpolate(
        grid, scale_factor=((rows + 0.1) / m, (cols + 0.1) / m), mode="bicubic", antialias=False
    )
    assert out.shape[-2:] == (rows, cols)
    return torch.cat([pos_embed[:, :1], out.permute(0, 2, 3, 1).reshape(1, -1, dim)], dim=1)


def test_rules_differ_off_native_and_agree_at_native() -> None:
    torch.manual_seed(0)
    table = torch.randn(1, 37 * 37, 16)
    same = [
        resample_patch_table(table, (37, 37), (37, 37), m)
        for m in ("bicubic", "bicubic_antialias", "bicubic_offset")
    ]
    assert all(t is table for t in same)
    a, b, c = (
        resample_patch_table(table, (37, 37), (16, 16), m)
        for m in ("bicubic", "bicubic_antialias", "bicubic_offset")
    )
    assert a.shape == b.shape == c.shape == (1, 256, 16)
    # the same checkpoint gets measurably different positions from the three stacks
    assert (a - b).abs().max() > 1e-2 and (a - c).abs().max() > 1e-3 and (b - c).abs().max() > 1e-2
    expected = F.interpolate(
        table.reshape(1, 37, 37, 16).permute(0, 3, 1, 2), size=(16, 16), mode="bicubic", antialias=True
    )
    assert torch.allclose(b, expected.permute(0, 2, 3, 1).reshape(1, 256, 16), atol=1e-6)


def test_cache_is_per_grid() -> None:
    table = torch.randn(1, 1 + 16, 8)
    cache = PositionTableCache(table, has_cls=True, method="bicubic")
    first = cache.get((5, 3), dtype=torch.float32, device=torch.device("cpu"))
    assert first.shape == (1, 1 + 15, 8)
    assert cache.get((5, 3), dtype=torch.float32, device=torch.device("cpu")) is first
    cache.get((4, 4), dtype=torch.float32, device=torch.device("cpu"))
    assert len(cache) == 2
    assert torch.equal(first[:, 0], table[:, 0])


def test_reference_rule_reproduces_the_dinov2_reference_forward(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["dinov2"]
    bb = load_backbone(path, interpolation="reference")
    assert bb.info().resample == "bicubic_offset"
    ref = tf.Dinov2Model.from_pretrained(path).eval()
    table = ref.embeddings.position_embeddings

    def reference_rule(embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        if (height // 14, width // 14) == (4, 4):
            return table
        return dinov2_reference_interpolation(table, height, width, 14)

    ref.embeddings.interpolate_pos_encoding = reference_rule
    default = load_backbone(path)
    for h, w in [(56, 56), (70, 98), (112, 56)]:
        x = torch.randn(2, 3, h, w)
        with torch.no_grad():
            expected = ref(x).last_hidden_state
        got = bb.features(x)
        assert got.cls is not None
        assert torch.allclose(got.cls, expected[:, 0], atol=1e-4)
        assert torch.allclose(got.patches.flatten(1, 2), expected[:, 1:], atol=1e-4)
        other = default.features(x)
        assert other.cls is not None
        if (h, w) == (56, 56):
            assert torch.allclose(other.cls, got.cls)
        else:
            assert not torch.allclose(other.cls, got.cls, atol=1e-5)


def test_rope_family_refuses_a_table_rule(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="rotary position embeddings"):
        load_backbone(tiny_checkpoints["dinov3"], interpolation="reference")
