"""``trim_*`` policies draft-decode JPEGs like the others: down to the box, decoding again at the scale a
large border asks for, so the trimmed photo is never upsampled and the features match a full-size decode."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import vit_backbone.preprocess as preprocess_module
from vit_backbone.decode import DecodedImage
from vit_backbone.preprocess import Preprocessor, stack, stack_valid
from vit_backbone.preprocess_config import PreprocessConfig

CONFIG = PreprocessConfig.from_processor_dict(  # DINOv2's: a 224x224 box
    {
        "image_processor_type": "BitImageProcessor",
        "size": {"shortest_edge": 256},
        "crop_size": {"height": 224, "width": 224},
        "resample": 3,
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
    }
)


def _jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _bordered(photo: Image.Image, canvas: tuple[int, int]) -> Image.Image:
    out = Image.new("RGB", canvas, (18, 18, 18))
    out.paste(photo, ((canvas[0] - photo.width) // 2, (canvas[1] - photo.height) // 2))
    return out


@pytest.fixture
def scales(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The draft scale of every decode the preprocessor runs."""
    seen: list[int] = []
    real = preprocess_module.decode

    def recording(*args: Any, **kwargs: Any) -> DecodedImage:
        decoded = real(*args, **kwargs)
        seen.append(decoded.draft_scale)
        return decoded

    monkeypatch.setattr(preprocess_module, "decode", recording)
    return seen


@pytest.mark.parametrize("policy", ["trim_squash", "trim_pad"])
def test_a_photo_is_drafted_and_matches_the_full_decode(
    sample_images: list[Image.Image], scales: list[int], policy: str
) -> None:
    pre = Preprocessor(CONFIG, (14, 14), (16, 16))
    for photo in sample_images:
        data = _jpeg(photo.resize((1600, 1200)))
        scales.clear()
        drafted = pre(data, policy=policy)  # type: ignore[arg-type]
        assert scales == [4]  # 1600x1200 -> 400x300, still covering the 224 box: one decode
        full = pre(data, policy=policy, draft=False)  # type: ignore[arg-type]
        assert drafted.grid == full.grid and drafted.source_size == full.source_size == (1200, 1600)
        diff = (drafted.pixel_values - full.pixel_values).abs()  # [3, H, W], normalised units
        assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.5


def test_a_large_border_decodes_again_at_the_scale_it_needs(
    sample_images: list[Image.Image], scales: list[int]
) -> None:
    pre = Preprocessor(CONFIG, (14, 14), (16, 16))
    photo = sample_images[2].resize((800, 600))  # a 800x600 photo on a 2880x2160 border
    data = _jpeg(_bordered(photo, (2880, 2160)))
    got = pre(data, policy="trim_squash")
    # the first draft (1/8: 360x270) leaves 100x75 of photo: decoded again at 1/2 (400x300 of photo)
    assert scales == [8, 2]
    full = pre(data, policy="trim_squash", draft=False)
    assert float((got.pixel_values - full.pixel_values).abs().mean()) < 0.02
    small = Image.new("RGB", (1600, 1200), (18, 18, 18))
    small.paste(photo.resize((400, 300)), (600, 450))  # 400x300 of photo: only full size covers 224 px
    scales.clear()
    pre(_jpeg(small), policy="trim_squash")
    assert scales == [4, 1]


@pytest.mark.slow
def test_drafted_embeddings_equal_full_decode_embeddings(
    sample_images: list[Image.Image], embedded_dir: Path
) -> None:
    from vit_backbone import load_backbone

    backbone = load_backbone(embedded_dir)
    pre = backbone.preprocessor
    photos = [(p.resize((1600, 1200)), 0.9999) for p in sample_images]
    # trimmed on a half-size decode, the border's edge lands within a pixel of the full-size trim's (0.9974)
    photos.append((_bordered(sample_images[0].resize((800, 600)), (2880, 2160)), 0.995))
    for photo, floor in photos:
        data = _jpeg(photo)
        vectors = []
        for draft in (True, False):
            prepared = pre(data, policy="trim_squash", draft=draft)
            pixels, _ = stack([prepared])  # [1, 3, H, W]
            vectors.append(backbone.pooled(pixels, "mean", [8], valid=stack_valid([prepared])))  # [1, D]
        assert float(torch.nn.functional.cosine_similarity(vectors[0], vectors[1])) > floor
