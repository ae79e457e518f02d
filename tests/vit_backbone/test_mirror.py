"""Mirror-averaged poolings (``*_hflip``): one pass on the batch and its mirror image, folded per image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from vit_backbone import InvalidOptionError, load_backbone
from vit_backbone.pooling import POOLINGS, pool_layers, pooled_dim
from vit_backbone.preprocess import stack


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def dinov2(tiny_checkpoints: dict[str, Path]) -> Any:
    return load_backbone(tiny_checkpoints["dinov2"])


@pytest.mark.parametrize("base", ["cls", "mean", "cls_mean", "gem"])
def test_mirrored_pooling_is_the_mean_of_the_unit_features_of_image_and_mirror(
    dinov2: Any, sample_images: list[Image.Image], base: str
) -> None:
    # square images: squash's pixels of the mirror image are exactly the mirror of the pixels
    images = [im.resize((112, 112)) for im in sample_images]
    options: dict[str, Any] = {"layers": [0, 1], "policy": "squash", "size": 56}
    got = dinov2.embed(images, pooling=f"{base}_hflip", **options)  # [B, F]
    plain = dinov2.embed(images, pooling=base, **options)
    mirrored = dinov2.embed([ImageOps.mirror(im) for im in images], pooling=base, **options)
    np.testing.assert_allclose(got, (_unit(plain) + _unit(mirrored)) / 2, atol=1e-5)
    assert got.shape == plain.shape  # the same width as the pooling it averages
    # a mirrored copy lands on its original's vector, which the plain pooling does not do
    flipped = dinov2.embed([ImageOps.mirror(im) for im in images], pooling=f"{base}_hflip", **options)
    np.testing.assert_allclose(flipped, got, atol=1e-5)
    assert np.abs(_unit(mirrored) - _unit(plain)).max() > 1e-3


def test_a_batch_mixing_masks_equals_item_by_item(dinov2: Any, sample_images: list[Image.Image]) -> None:
    """pad's letterbox mask is mirrored with the pixels: a batch of different aspect ratios equals each
    image alone."""
    batch = dinov2.embed(sample_images, pooling="mean_hflip", policy="pad", size=56)
    alone = np.concatenate(
        [dinov2.embed([im], pooling="mean_hflip", policy="pad", size=56) for im in sample_images]
    )
    np.testing.assert_allclose(batch, alone, atol=1e-5)


def test_pooled_many_reads_the_unmirrored_half_for_other_requests(
    dinov2: Any, sample_images: list[Image.Image]
) -> None:
    prepared = dinov2.prepare(sample_images, policy="squash", size=56)
    pixels, _ = stack(prepared)  # [b, 3, H, W]
    valid = torch.ones(len(prepared), 4, 4)  # [b, h, w]
    valid[:, :, 3] = 0.0  # a mask that is not left-right symmetric: it must be mirrored with the pixels
    valid[0, 1, 0] = 0.5
    with torch.inference_mode():
        mirrored, patch, mean = dinov2.pooled_many(
            pixels, [("cls_mean_hflip", [1]), ("patch", [0]), ("mean", None)], valid=valid
        )
        plain = dinov2.pooled(pixels, "cls_mean", [1], valid=valid)  # [b, F]
        flipped = dinov2.pooled(pixels.flip(-1), "cls_mean", [1], valid=valid.flip(-1))  # the mirror images
        unit = torch.nn.functional.normalize
        assert torch.allclose(mirrored, (unit(plain, dim=-1) + unit(flipped, dim=-1)) / 2, atol=1e-5)
        unflipped_mask = dinov2.pooled(pixels.flip(-1), "cls_mean", [1], valid=valid)
        wrong = (unit(plain, dim=-1) + unit(unflipped_mask, dim=-1)) / 2
        assert (mirrored - wrong).abs().max() > 1e-4  # the mask's mirroring matters here
        assert torch.allclose(patch, dinov2.pooled(pixels, "patch", [0], valid=valid), atol=1e-5)
        assert torch.allclose(mean, dinov2.pooled(pixels, "mean", None, valid=valid), atol=1e-5)
    assert tuple(mirrored.shape) == (len(sample_images), pooled_dim("cls_mean_hflip", dinov2.dim, 1))
    assert tuple(patch.shape[:3]) == (len(sample_images), 4, 4)


def test_a_models_own_head_reads_the_unmirrored_half(tiny_checkpoints: dict[str, Path]) -> None:
    """projection (the whole network) beside a mirrored pooling in one pass equals projection alone."""
    clip = load_backbone(tiny_checkpoints["clip"])
    pixels = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        projection, mirrored = clip.pooled_many(pixels, [("projection", None), ("mean_hflip", None)])
        assert torch.allclose(projection, clip.pooled(pixels, "projection", None), atol=1e-5)
        plain = clip.pooled(pixels, "mean", None)
        flipped = clip.pooled(pixels.flip(-1), "mean", None)
        unit = torch.nn.functional.normalize
        assert torch.allclose(mirrored, (unit(plain, dim=-1) + unit(flipped, dim=-1)) / 2, atol=1e-5)


def test_tokens_already_computed_cannot_be_mirror_pooled(
    dinov2: Any, sample_images: list[Image.Image]
) -> None:
    prepared = dinov2.prepare(sample_images[:1], policy="squash", size=56)
    pixels, _ = stack(prepared)
    tokens = dinov2.layer_features(pixels, [1])
    with pytest.raises(InvalidOptionError, match="mirror image, so it needs both forward passes"):
        pool_layers(tokens, "mean_hflip", [1])


def test_mirrored_poolings_are_listed_and_need_cls_where_their_base_does(
    tiny_checkpoints: dict[str, Path],
) -> None:
    assert {"cls_hflip", "mean_hflip", "cls_mean_hflip", "gem_hflip"} <= set(POOLINGS)
    siglip = load_backbone(tiny_checkpoints["siglip"])
    offered = siglip.info().poolings
    assert "mean_hflip" in offered and "gem_hflip" in offered
    assert "cls_hflip" not in offered and "cls_mean_hflip" not in offered
    with pytest.raises(InvalidOptionError, match="needs a CLS token"):
        siglip.embed([Image.new("RGB", (64, 64))], pooling="cls_mean_hflip")


def test_a_mirrored_pooling_costs_two_passes_wherever_it_shares_the_batch() -> None:
    from vit_backbone.mirror import forward_passes

    assert forward_passes(["mean"]) == forward_passes(["cls", "patch"]) == 1
    assert forward_passes(["cls_mean_hflip"]) == forward_passes(["patch", "mean_hflip"]) == 2
