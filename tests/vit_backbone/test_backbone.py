"""Features and poolings equal what transformers computes, for every family and at non-native sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf

from vit_backbone import InvalidOptionError, SizeError, load_backbone
from vit_backbone.backbone import Backbone

FAMILIES = ("dinov2", "dinov2_registers", "dinov3", "vit", "clip", "siglip")


def reference_model(bb: Backbone) -> Any:
    return getattr(tf, bb.spec.model_class).from_pretrained(bb.checkpoint.path).eval()


def reference_tokens(bb: Backbone, ref: Any, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """transformers' own forward: every token after the family's final norm."""
    kwargs = {"interpolate_pos_encoding": True} if bb.spec.needs_interpolate_flag else {}
    with torch.no_grad():
        out = ref(x, output_hidden_states=True, **kwargs)
    tokens = out.last_hidden_state
    if bb.spec.name == "clip":  # CLIP applies post_layernorm to the pooled CLS only
        tokens = ref.post_layernorm(tokens)
    return tokens, out


@pytest.fixture(scope="module")
def backbones(tiny_checkpoints: dict[str, Path]) -> dict[str, Backbone]:
    return {family: load_backbone(path) for family, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_features_equal_transformers_at_native_and_three_other_sizes(
    backbones: dict[str, Backbone], family: str
) -> None:
    bb = backbones[family]
    ref = reference_model(bb)
    (ph, pw), (nh, nw) = bb.patch_size, bb.native_grid
    torch.manual_seed(1)
    for gh, gw in [(nh, nw), (nh + 1, nw + 1), (nh - 1, nw + 3), (2 * nh, nw)]:
        x = torch.randn(2, 3, gh * ph, gw * pw)
        feats = bb.features(x)
        tokens, out = reference_tokens(bb, ref, x)
        assert feats.grid == (gh, gw)
        patches = tokens[:, bb.prefix_tokens :].reshape(2, gh, gw, -1)
        assert torch.allclose(feats.patches, patches, atol=1e-4, rtol=0)
        if bb.spec.has_cls:
            assert feats.cls is not None
            assert torch.allclose(feats.cls, tokens[:, 0], atol=1e-4, rtol=0)
        else:
            assert feats.cls is None
        assert feats.registers.shape[1] == bb.num_registers
        if bb.num_registers:
            assert torch.allclose(feats.registers, tokens[:, 1 : bb.prefix_tokens], atol=1e-4, rtol=0)
        assert feats.pooler is not None
        assert torch.allclose(feats.pooler, out.pooler_output, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_intermediate_layers_are_hidden_states_through_the_final_norm(
    backbones: dict[str, Backbone], family: str
) -> None:
    bb = backbones[family]
    ref = reference_model(bb)
    x = torch.randn(2, 3, bb.native_grid[0] * bb.patch_size[0], (bb.native_grid[1] + 2) * bb.patch_size[1])
    feats = bb.features(x, layers=[0, -1])
    _, out = reference_tokens(bb, ref, x)
    norm = getattr(ref, bb.spec.final_norm)
    with torch.no_grad():
        first = norm(out.hidden_states[1])  # block 0's output
    assert set(feats.layers) == {0, 1}
    got = feats.layers[0].patches.flatten(1, 2)
    assert torch.allclose(got, first[:, bb.prefix_tokens :], atol=1e-5, rtol=0)
    # the un-normed hidden state is a different feature
    assert not torch.allclose(got, out.hidden_states[1][:, bb.prefix_tokens :], atol=1e-3)
    assert torch.allclose(feats.layers[1].patches, feats.patches)


def test_vit_pooler_is_tanh_dense_not_the_cls_token(backbones: dict[str, Backbone]) -> None:
    bb = backbones["vit"]
    x = torch.randn(3, 3, 64, 64)
    feats = bb.features(x)
    assert feats.cls is not None and feats.pooler is not None
    dense = bb.model.pooler.dense
    with torch.no_grad():
        expected = torch.tanh(dense(feats.cls))
    assert torch.allclose(feats.pooler, expected, atol=1e-6)
    assert not torch.allclose(feats.pooler, feats.cls, atol=1e-2)
    assert feats.pooler.abs().max() <= 1.0
    cls = bb.embed_prepared([_prep(bb, x[i]) for i in range(3)], pooling="cls")
    pooler = bb.embed_prepared([_prep(bb, x[i]) for i in range(3)], pooling="pooler")
    assert np.allclose(cls, feats.cls.numpy(), atol=1e-5)
    assert np.allclose(pooler, feats.pooler.numpy(), atol=1e-5)


def _prep(bb: Backbone, pixel_values: torch.Tensor) -> Any:
    from vit_backbone.preprocess import Prepared

    h, w = pixel_values.shape[-2:]
    grid = (h // bb.patch_size[0], w // bb.patch_size[1])
    return Prepared(pixel_values=pixel_values, grid=grid, source_size=(h, w), policy="squash")


@pytest.mark.parametrize("family", ["dinov2_registers", "dinov3"])
def test_poolings_exclude_prefix_tokens_and_concatenate_layers(
    backbones: dict[str, Backbone], family: str
) -> None:
    bb = backbones[family]
    ref = reference_model(bb)
    torch.manual_seed(2)
    x = torch.randn(3, 3, bb.native_grid[0] * bb.patch_size[0], bb.native_grid[1] * bb.patch_size[1])
    prepared = [_prep(bb, x[i]) for i in range(3)]
    tokens, out = reference_tokens(bb, ref, x)
    norm = getattr(ref, bb.spec.final_norm)
    p = bb.prefix_tokens
    cls, patch_mean = tokens[:, 0], tokens[:, p:].mean(dim=1)
    with torch.no_grad():
        block0 = norm(out.hidden_states[1])
    np.testing.assert_allclose(bb.embed_prepared(prepared, pooling="mean"), patch_mean.numpy(), atol=1e-5)
    # including the CLS and registers in the mean would be a different (wrong) feature
    assert not np.allclose(bb.embed_prepared(prepared, pooling="mean"), tokens.mean(dim=1).numpy(), atol=1e-3)
    np.testing.assert_allclose(
        bb.embed_prepared(prepared, pooling="cls_mean"), torch.cat([cls, patch_mean], -1).numpy(), atol=1e-5
    )
    np.testing.assert_allclose(
        bb.embed_prepared(prepared, pooling="cls", layers=[0, -1]),
        torch.cat([block0[:, 0], cls], -1).numpy(),
        atol=1e-5,
    )
    # DINOv2 linear-eval input: CLS of each block, then the last block's mean patch token
    np.testing.assert_allclose(
        bb.embed_prepared(prepared, pooling="linear_eval", layers=[-2, -1]),
        torch.cat([block0[:, 0], cls, patch_mean], -1).numpy(),
        atol=1e-5,
    )
    grid = bb.embed_prepared(prepared, pooling="patch")
    assert grid.shape == (3, *bb.native_grid, bb.dim)
    np.testing.assert_allclose(grid.reshape(3, -1, bb.dim), tokens[:, p:].numpy(), atol=1e-5)
    gem = bb.embed_prepared(prepared, pooling="gem")
    x3 = tokens[:, p:].double()
    m = (x3.sign() * x3.abs() ** 3).mean(1)
    np.testing.assert_allclose(gem, (m.sign() * m.abs() ** (1 / 3)).numpy(), atol=1e-5)
    unit = bb.embed_prepared(prepared, pooling="cls_mean", normalize=True)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)


def test_siglip_has_no_cls_and_says_what_to_use(backbones: dict[str, Backbone]) -> None:
    bb = backbones["siglip"]
    prepared = [_prep(bb, torch.randn(3, 64, 64))]
    with pytest.raises(InvalidOptionError, match=r"needs a CLS token.*pooling=.pooler."):
        bb.embed_prepared(prepared, pooling="cls")
    assert bb.defaults.pooling == "pooler"
    assert bb.embed_prepared(prepared).shape == (1, bb.dim)


def test_non_multiple_pixel_size_is_refused_not_cropped(backbones: dict[str, Backbone]) -> None:
    bb = backbones["dinov2"]
    with pytest.raises(
        SizeError, match=r"not a positive multiple of the patch 14x14.*Nearest multiples: 56 or 70x56"
    ):
        bb.features(torch.randn(1, 3, 60, 56))


def test_layer_selection_errors(backbones: dict[str, Backbone]) -> None:
    bb = backbones["dinov2"]
    assert bb.resolve_layers(-1) == [1]
    assert bb.resolve_layers([0, -1]) == [0, 1]
    with pytest.raises(InvalidOptionError, match="has 2 blocks"):
        bb.resolve_layers([5])
    with pytest.raises(InvalidOptionError, match="same block twice"):
        bb.resolve_layers([1, -1])
    with pytest.raises(InvalidOptionError, match="unknown pooling"):
        bb.embed_prepared([_prep(bb, torch.randn(3, 56, 56))], pooling="max")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="drop `layers`"):
        bb.embed_prepared([_prep(bb, torch.randn(3, 56, 56))], pooling="pooler", layers=[0])


def test_info_states_the_facts(backbones: dict[str, Backbone], tiny_checkpoints: dict[str, Path]) -> None:
    info = backbones["dinov2_registers"].info()
    assert (info.family, info.dim, info.depth, info.heads) == ("dinov2_registers", 32, 2, 2)
    assert info.patch_size == (14, 14) and info.native_grid == (4, 4) and info.native_size == (56, 56)
    assert (info.prefix_tokens, info.registers, info.has_cls) == (5, 4, True)
    assert (info.interpolation, info.resample) == ("transformers", "bicubic_antialias")
    assert info.params == sum(p.numel() for p in backbones["dinov2_registers"].model.parameters())
    assert info.revision.startswith("local-") and info.source == "local"
    assert len(info.preprocess_hash) == 16
    assert backbones["dinov3"].info().interpolation == "rope"
    assert backbones["siglip"].info().prefix_tokens == 0
    assert backbones["dinov2"].info().resample == "bicubic"
    assert info.to_dict()["preprocess_hash"] == info.preprocess_hash


def _jpeg(width: int, height: int, seed: int) -> bytes:
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, size=(height // 8, width // 8, 3), dtype=np.uint8)
    image = Image.fromarray(array).resize((width, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def test_embed_from_bytes_keeps_input_order_across_grids(backbones: dict[str, Backbone]) -> None:
    bb = backbones["dinov2"]
    images = [_jpeg(320, 160, 0), _jpeg(200, 200, 1), _jpeg(160, 320, 2), _jpeg(330, 170, 3)]
    result = bb.embed_result(images, pooling="mean", policy="dynamic", batch_size=2)
    # dynamic keeps the aspect ratio within the processor's 4x4 = 16-token budget
    assert result.grids == [(3, 5), (4, 4), (5, 3), (3, 5)]
    assert (result.pooling, result.policy, result.layers, result.normalized) == (
        "mean",
        "dynamic",
        None,
        False,
    )
    assert result.preprocess_hash == bb.info().preprocess_hash and result.revision == bb.info().revision
    for index, image in enumerate(images):  # one at a time: the same vector whatever the batch
        alone = bb.embed([image], pooling="mean", policy="dynamic")
        np.testing.assert_allclose(result.vectors[index], alone[0], atol=1e-5)
    with pytest.raises(InvalidOptionError, match="different grids"):
        bb.embed(images, pooling="patch", policy="dynamic")
    assert bb.embed(images, pooling="patch", policy="squash").shape == (4, 4, 4, 32)


def test_embed_equals_features_of_the_prepared_batch(backbones: dict[str, Backbone]) -> None:
    from vit_backbone.preprocess import stack

    bb = backbones["clip"]
    images = [_jpeg(300, 200, 4), _jpeg(120, 180, 5)]
    pixel_values, grid = stack(bb.prepare(images, policy="crop", draft=False))
    assert grid == (4, 4) and pixel_values.shape == (2, 3, 64, 64)
    feats = bb.features(pixel_values, layers=[0])
    assert feats.cls is not None
    np.testing.assert_allclose(bb.embed(images, pooling="cls", draft=False), feats.cls.numpy(), atol=1e-6)
    np.testing.assert_allclose(
        bb.embed(images, pooling="cls", layers=0, draft=False),
        feats.layers[0].cls.numpy(),
        atol=1e-6,  # type: ignore[union-attr]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_early_exit_gives_the_same_blocks_and_leaves_the_model_whole(
    tiny_checkpoints: dict[str, Path], family: str
) -> None:
    bb = load_backbone(tiny_checkpoints[family])  # fresh: an early exit is its very first forward pass
    (ph, pw), (nh, nw) = bb.patch_size, bb.native_grid
    x = torch.randn(2, 3, nh * ph, (nw + 1) * pw)
    early = bb.layer_features(x, [0])
    full = bb.features(x, layers=[0])
    untouched = load_backbone(tiny_checkpoints[family]).features(x)
    assert torch.allclose(full.patches, untouched.patches, atol=1e-6)  # the last block is still the last
    assert set(early) == {0}
    assert torch.allclose(early[0].patches, full.layers[0].patches, atol=1e-6)
    if bb.spec.has_cls:
        assert torch.allclose(early[0].cls, full.layers[0].cls, atol=1e-6)  # type: ignore[arg-type]
    calls: list[int] = []
    blocks = bb._blocks_owner
    hooks = [
        block.register_forward_hook(lambda *_: calls.append(1)) for block in getattr(blocks, bb._blocks_name)
    ]
    try:
        bb.pooled(x, "mean", [0])
        assert len(calls) == 1  # block 0 only: the second block never ran
        calls.clear()
        again = bb.features(x)
        assert len(calls) == bb.depth  # the full model is back
        assert torch.allclose(again.patches, full.patches)
    finally:
        for hook in hooks:
            hook.remove()
