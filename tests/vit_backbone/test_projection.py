"""pooling='projection': a full CLIP/SigLIP checkpoint's image embedding equals transformers'
get_image_features where transformers sees the same pixels (crop, squash), and is their default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

from vit_backbone import Backbone, load_backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.preprocess import stack, stack_valid
from vit_backbone.projection import masked_head

TEXT = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
VISION = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}


@pytest.fixture(scope="module")
def full_siglip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("siglip-full") / "siglip"
    config = tf.SiglipConfig(text_config=TEXT, vision_config={**VISION, "patch_size": 16, "image_size": 64})
    tf.SiglipModel(config).save_pretrained(folder, safe_serialization=True)
    tf.SiglipImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def full(tiny_checkpoints: dict[str, Path], full_siglip: Path) -> dict[str, tuple[Backbone, Any]]:
    """family -> (our backbone, the transformers dual encoder): full CLIP (projection_dim 16) and SigLIP."""
    out = {}
    for family, folder, cls in (
        ("clip", tiny_checkpoints["clip"], tf.CLIPModel),
        ("siglip", full_siglip, tf.SiglipModel),
    ):
        out[family] = (load_backbone(folder), cls.from_pretrained(folder).eval())
    return out


def _image_features(model: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model.get_image_features(pixel_values=pixel_values)
    return out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 5 returns the output


@pytest.mark.parametrize("family", ["clip", "siglip"])
@pytest.mark.parametrize("policy", ["crop", "squash"])
def test_projection_equals_get_image_features(
    family: str, policy: str, full: dict[str, tuple[Backbone, Any]], sample_images: list[Any]
) -> None:
    bb, reference = full[family]
    pixel_values, _ = stack(bb.prepare(sample_images, policy=policy))  # type: ignore[arg-type]  # [4, 3, 64, 64]
    want = _image_features(reference, pixel_values).numpy()  # [4, E]
    got = bb.embed(sample_images, pooling="projection", policy=policy)  # type: ignore[arg-type]
    assert got.shape == want.shape == (4, 16 if family == "clip" else 32)
    assert np.abs(got - want).max() <= 1e-5
    assert bb.output_dim("projection", None) == want.shape[1]
    # the default of a full checkpoint, listed in info(); the tower's own tokens stay available by name
    assert bb.defaults.pooling == "projection" and "projection" in bb.info().poolings
    assert np.array_equal(bb.embed(sample_images, policy=policy), got)  # type: ignore[arg-type]
    tower = bb.embed(sample_images[:1], pooling="mean", policy=policy)  # type: ignore[arg-type]
    assert tower.shape == (1, 32)


def test_siglip_projection_with_pad_masks_the_letterbox_out_of_the_head(
    full: dict[str, tuple[Backbone, Any]], sample_images: list[Any]
) -> None:
    """With pad, the head's probe attends to image patches only: equal to the head run on those tokens alone,
    and different from the unmasked head (which attends to the letterbox too)."""
    bb, _ = full["siglip"]
    prepared = bb.prepare(sample_images, policy="pad")
    pixel_values, _ = stack(prepared)  # [4, 3, 64, 64]
    valid = stack_valid(prepared)  # [4, 4, 4]
    assert valid is not None and (valid == 0).any()
    feats = bb.features(pixel_values, valid=valid)
    assert bb.projection is not None
    head = bb.projection.module
    for i in range(len(prepared)):
        tokens = feats.patches[i].flatten(0, 1)[valid[i].flatten() > 0]  # [n_image, D]
        alone = masked_head(head, tokens[None], None)  # [1, D]
        assert feats.projection is not None
        assert torch.allclose(feats.projection[i], alone[0], atol=1e-5)
    unmasked = masked_head(head, feats.patches.flatten(1, 2), None)  # [4, D]
    assert feats.projection is not None and not torch.allclose(feats.projection, unmasked, atol=1e-4)
    assert feats.pooler is not None and torch.allclose(feats.pooler, unmasked, atol=1e-5)  # the model's own


def test_projection_is_refused_where_there_is_none(tiny_checkpoints: dict[str, Path]) -> None:
    vision_only = load_backbone(tiny_checkpoints["siglip"])  # SiglipVisionModel: no joint space
    assert vision_only.projection is None and "projection" not in vision_only.info().poolings
    assert vision_only.defaults.pooling == "pooler"
    with pytest.raises(InvalidOptionError, match="full CLIP or SigLIP"):
        vision_only.embed([Image.new("RGB", (64, 64))], pooling="projection")
    dino = load_backbone(tiny_checkpoints["dinov2"])
    assert dino.defaults.pooling == "cls" and "projection" not in dino.info().poolings
