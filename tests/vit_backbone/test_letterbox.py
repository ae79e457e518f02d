"""Padding-aware features: with ``pad`` every result knows which patches hold image, poolings average only
the image, letterbox tokens are out of attention and image patches get their own grid's positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vit_backbone import load_backbone
from vit_backbone.pooling import mean_patches
from vit_backbone.preprocess import patch_coverage, stack, stack_valid


def test_patch_coverage_is_exact_for_known_sizes() -> None:
    # a 20-row image placed at row 14 of a 4x2 grid of 14x14 patches: rows 1 full, row 2 6/14, rest 0
    got = patch_coverage((4, 2), (14, 14), (14, 0), (20, 28))
    want = np.outer([0.0, 1.0, 6 / 14, 0.0], [1.0, 1.0]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_pad_validity_mask_is_exact(tiny_checkpoints: dict[str, Path]) -> None:
    bb = load_backbone(tiny_checkpoints["dinov2"])  # patch 14
    wide = Image.new("RGB", (200, 50), (200, 10, 10))
    prepared = bb.prepare(wide, policy="pad", size=(56, 56))[0]
    # fit 56 x 14 (50 * 56 / 200 = 14): one row of patches, centred to the nearest whole patch: row 1
    assert prepared.grid == (4, 4)
    want = np.zeros((4, 4), np.float32)
    want[1] = 1.0
    np.testing.assert_array_equal(prepared.valid, want)
    odd = Image.new("RGB", (200, 75), (10, 200, 10))  # fit 56 x 21: 1.5 rows → row 1 full, row 2 half
    np.testing.assert_array_equal(
        bb.prepare(odd, policy="pad", size=(56, 56))[0].valid,
        np.outer([0.0, 1.0, 0.5, 0.0], [1.0] * 4).astype(np.float32),
    )
    square = Image.new("RGB", (80, 80), (10, 10, 200))
    assert bb.prepare(square, policy="pad", size=(56, 56))[0].valid is None  # no letterbox at all
    assert bb.prepare(wide, policy="squash", size=(56, 56))[0].valid is None
    result = bb.embed_result([wide, square], pooling="patch", policy="pad", size=(56, 56))
    np.testing.assert_array_equal(result.valid[0], want)
    np.testing.assert_array_equal(result.valid[1], np.ones((4, 4), np.float32))


def test_mean_uses_only_image_patches(tiny_checkpoints: dict[str, Path], sample_images: list[Any]) -> None:
    bb = load_backbone(tiny_checkpoints["vit"])
    prepared = bb.prepare(sample_images[3], policy="pad")  # rocket: portrait, letterboxed left and right
    valid = stack_valid(prepared)
    assert valid is not None and 0 < float(valid.mean()) < 1
    pixels, _ = stack(prepared)
    tokens = bb.layer_features(pixels, [1], valid=valid)[1]
    weights = valid.flatten(1)[0]  # [N]
    by_hand = (tokens.patches.flatten(1, 2)[0] * weights[:, None]).sum(0) / weights.sum()  # [D]
    torch.testing.assert_close(mean_patches(tokens)[0], by_hand, rtol=1e-5, atol=1e-6)
    pooled = bb.embed(sample_images[3], pooling="mean", layers=[1], policy="pad")[0]
    np.testing.assert_allclose(pooled, by_hand.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["dinov2", "vit", "siglip", "dinov3"])
def test_batch_mixing_masks_equals_item_by_item(
    tiny_checkpoints: dict[str, Path], sample_images: list[Any], family: str
) -> None:
    bb = load_backbone(tiny_checkpoints[family])
    wide = sample_images[0].crop((0, 0, 512, 160))
    images = [*sample_images, wide, Image.new("RGB", (64, 64), (120, 30, 200))]  # aspects + one unpadded
    size = (8 * bb.patch_size[0], 8 * bb.patch_size[1])
    for pooling in ("mean", "gem", "patch"):
        batch = bb.embed(images, pooling=pooling, policy="pad", size=size, batch_size=len(images))
        alone = np.stack([bb.embed([i], pooling=pooling, policy="pad", size=size)[0] for i in images])
        np.testing.assert_allclose(batch, alone, rtol=1e-4, atol=1e-5)
    masks = {p.validity().tobytes() for p in bb.prepare(images, policy="pad", size=size)}
    assert len(masks) >= 3  # the batch really mixed different letterboxes


def test_box_around_the_image_does_not_change_it(tiny_checkpoints: dict[str, Path]) -> None:
    """Same image, same scale, boxes of different aspect: the letterbox no longer reaches the features."""
    bb = load_backbone(tiny_checkpoints["dinov2"])
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (40, 112, 3), dtype=np.uint8))  # fits 112 x 40 in both
    a = bb.embed(image, pooling="mean", policy="pad", size=(112, 112))[0]
    b = bb.embed(image, pooling="mean", policy="pad", size=(56, 112))[0]
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_letterbox_cosine_with_real_weights(embedded_dir: Path) -> None:
    """Real photos, real weights: another letterbox (target aspect) keeps the mean embedding within
    cosine 0.99; what the old pooling (every patch, letterbox included) did scores below that."""
    from skimage import data

    bb = load_backbone(embedded_dir)
    photos = [
        Image.fromarray(data.astronaut()).convert("RGB").crop((0, 0, 512, 300)),
        Image.fromarray(data.coffee()).convert("RGB"),
        Image.fromarray(data.rocket()).convert("RGB"),
    ]
    boxes = [(140, 224), (154, 224), (154, 224)]  # each photo's own fit, rounded up to whole patches

    def embed(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
        return bb.embed(image, pooling="mean", layers=[8], policy="pad", size=size, normalize=True)[0]

    def old_mean(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
        prepared = bb.prepare(image, policy="pad", size=size)
        pixels, _ = stack(prepared)
        patches = bb.layer_features(pixels, [8])[8].patches.flatten(1, 2)  # [1, N, D], no mask
        return torch.nn.functional.normalize(patches.mean(dim=1), dim=-1)[0].numpy()

    for photo, box in zip(photos, boxes, strict=True):
        assert float(embed(photo, (224, 224)) @ embed(photo, box)) >= 0.99
        assert float(old_mean(photo, (224, 224)) @ old_mean(photo, box)) < 0.99
    different = float(embed(photos[0], (224, 224)) @ embed(photos[1], (224, 224)))
    assert different < 0.8
