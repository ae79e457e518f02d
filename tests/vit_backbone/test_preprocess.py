"""preprocess.py: bit parity with transformers' PIL processors, policy arithmetic, errors, batching."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import skimage.data
import torch
import transformers as tf
from PIL import Image

from vit_backbone.errors import ImageDecodeError, InvalidOptionError, SizeError
from vit_backbone.preprocess import Prepared, PreprocessConfig, Preprocessor, ResizePolicy, stack

IMAGENET: dict[str, Any] = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}

# family → (transformers PIL processor with the family's typical config, patch size)
FAMILIES: dict[str, tuple[Callable[[], Any], tuple[int, int]]] = {
    "dinov2": (
        lambda: tf.BitImageProcessorPil(
            size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, resample=3, **IMAGENET
        ),
        (14, 14),
    ),
    "vit": (lambda: tf.ViTImageProcessorPil(size={"height": 224, "width": 224}), (16, 16)),
    "clip": (lambda: tf.CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size=224), (14, 14)),
    "siglip": (lambda: tf.SiglipImageProcessorPil(size={"height": 224, "width": 224}), (16, 16)),
}


def _tile(arr: np.ndarray, height: int, width: int) -> np.ndarray:
    reps = (-(-height // arr.shape[0]), -(-width // arr.shape[1]), 1)
    return np.ascontiguousarray(np.tile(arr, reps)[:height, :width])


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    rocket = skimage.data.rocket()
    arrays = {name: getattr(skimage.data, name)() for name in ("astronaut", "coffee", "chelsea", "rocket")}
    arrays["333x517"] = _tile(rocket, 333, 517)
    arrays["517x333"] = _tile(rocket, 517, 333)
    arrays["tiny_97x61"] = _tile(rocket, 97, 61)
    return {name: Image.fromarray(arr) for name, arr in arrays.items()}


def config_of(processor: Any) -> PreprocessConfig:
    """Through JSON, as a checkpoint's preprocessor_config.json would be read."""
    return PreprocessConfig.from_processor_dict(json.loads(processor.to_json_string()))


def dinov2() -> Preprocessor:
    return Preprocessor(config_of(FAMILIES["dinov2"][0]()), (14, 14), (16, 16))


def jpeg_bytes(width: int, height: int) -> bytes:
    img = Image.fromarray(skimage.data.coffee()).resize((width, height), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


# --- parity ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_crop_policy_matches_transformers_pil_processor(family: str, images: dict[str, Image.Image]) -> None:
    make, patch = FAMILIES[family]
    processor = make()
    pre = Preprocessor(config_of(processor), patch, (224 // patch[0], 224 // patch[1]))
    for name, img in images.items():
        expected = torch.as_tensor(processor(img, return_tensors="np")["pixel_values"][0])  # [3, 224, 224]
        got = pre(img, draft=False)
        assert got.pixel_values.dtype == torch.float32
        assert got.pixel_values.shape == expected.shape == (3, 224, 224), name
        assert (got.pixel_values - expected).abs().max().item() <= 1e-5, name
        assert got.grid == (224 // patch[0], 224 // patch[1])
        assert got.source_size == (img.height, img.width)


def test_crop_policy_from_bytes_without_draft_matches_too(images: dict[str, Image.Image]) -> None:
    processor = FAMILIES["dinov2"][0]()
    buf = io.BytesIO()
    images["chelsea"].save(buf, "PNG")
    expected = torch.as_tensor(processor(images["chelsea"], return_tensors="np")["pixel_values"][0])
    got = dinov2()(buf.getvalue(), draft=False)
    assert (got.pixel_values - expected).abs().max().item() <= 1e-5


def test_crop_with_size_scales_the_checkpoint_ratio(images: dict[str, Image.Image]) -> None:
    # DINOv2 resizes 256 → crops 224; at 448 the same pipeline is 512 → 448.
    reference = tf.BitImageProcessorPil(
        size={"shortest_edge": 512}, crop_size={"height": 448, "width": 448}, resample=3, **IMAGENET
    )
    for img in images.values():
        expected = torch.as_tensor(reference(img, return_tensors="np")["pixel_values"][0])
        got = dinov2()(img, size=(448, 448), draft=False)
        assert got.grid == (32, 32)
        assert (got.pixel_values - expected).abs().max().item() <= 1e-5
    wide = dinov2()(images["coffee"], size=(224, 336))  # non-square: cover (256, 384), crop
    assert wide.pixel_values.shape == (3, 224, 336) and wide.grid == (16, 24)
    assert dinov2().target_size("crop", (224, 336), (400, 600)) == (224, 336)
    assert dinov2().min_decode_size("crop", (224, 336), (400, 600)) == (384, 256)  # (min_w, min_h)


@pytest.mark.parametrize("family", ["vit", "siglip"])
def test_crop_with_size_resizes_directly_when_the_checkpoint_has_no_crop(
    family: str, images: dict[str, Image.Image]
) -> None:
    make, patch = FAMILIES[family]
    reference = make()
    reference_384 = type(reference)(**{**reference.to_dict(), "size": {"height": 384, "width": 384}})
    pre = Preprocessor(config_of(reference), patch, (14, 14))
    expected = torch.as_tensor(reference_384(images["rocket"], return_tensors="np")["pixel_values"][0])
    got = pre(images["rocket"], size=(384, 384))
    assert got.grid == (24, 24) and (got.pixel_values - expected).abs().max().item() <= 1e-5


def test_dinov3_pipeline_rescales_before_a_float_resize() -> None:
    cfg = PreprocessConfig.from_processor_dict({"image_processor_type": "DINOv3ViTImageProcessor"})
    pre = Preprocessor(cfg, (16, 16), (14, 14))
    flat = pre(Image.new("RGB", (300, 200), (200, 100, 50))).pixel_values  # [3, 224, 224]
    expected = (
        torch.tensor([200, 100, 50]) * (1 / 255) - torch.tensor(IMAGENET["image_mean"])
    ) / torch.tensor(IMAGENET["image_std"])
    assert torch.allclose(flat, expected.view(3, 1, 1).expand(3, 224, 224), atol=1e-6)
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (97, 133, 3), dtype=np.uint8))
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous() * (1 / 255)
    x = torch.nn.functional.interpolate(
        x[None], (224, 224), mode="bilinear", align_corners=False, antialias=True
    )
    mean, std = (torch.tensor(IMAGENET[k]).view(3, 1, 1) for k in ("image_mean", "image_std"))
    assert torch.equal(pre(img).pixel_values, ((x[0] - mean) / std))


def test_dinov3_parity_with_transformers_when_torchvision_is_available(
    images: dict[str, Image.Image],
) -> None:
    pytest.importorskip("torchvision")  # DINOv3ViTImageProcessor has no PIL backend
    processor = tf.DINOv3ViTImageProcessor()
    pre = Preprocessor(config_of(processor), (16, 16), (14, 14))
    for img in images.values():
        expected = processor(img, return_tensors="pt")["pixel_values"][0]
        assert (pre(img, draft=False).pixel_values - expected).abs().max().item() <= 1e-5


# --- policy arithmetic -------------------------------------------------------------------------------


def test_dynamic_fits_the_token_budget_on_the_patch_grid() -> None:
    pre = dinov2()
    assert pre.target_size("dynamic", None, (1200, 1600)) == (196, 252)  # 14 x 18 = 252 <= 256 tokens
    assert pre.target_size("dynamic", None, (512, 512)) == (224, 224)
    assert pre.target_size("dynamic", (448, 448), (1200, 1600)) == (378, 518)  # budget 1024: 27 x 37
    # thin (aspect 17.4): 4 x 64 rows x cols (aspect 16); rounding 3.8 rows down to 3 would waste budget
    assert pre.target_size("dynamic", None, (87, 1513)) == (56, 896)
    out = pre(Image.new("RGB", (1600, 1200), (90, 90, 90)), policy="dynamic")
    assert out.pixel_values.shape == (3, 196, 252) and out.grid == (14, 18)
    for source in [(1, 1), (5, 7000), (7000, 5), (333, 517), (4000, 3000), (123, 4567)]:
        h, w = pre.target_size("dynamic", None, source)
        assert h % 14 == 0 and w % 14 == 0 and h >= 14 and w >= 14
        assert (h // 14) * (w // 14) <= 256
    assert pre.min_decode_size("dynamic", None, (1200, 1600)) == (252, 196)


def test_squash_and_pad() -> None:
    pre = dinov2()
    img = Image.new("RGB", (1600, 1200), (200, 30, 30))
    squash = pre(img, policy="squash", size=(140, 280))
    assert squash.pixel_values.shape == (3, 140, 280) and squash.grid == (10, 20)
    assert pre.target_size("squash", None, (1200, 1600)) == (224, 224)
    padded = pre(img, policy="pad").pixel_values  # fits as 168 x 224, centred: 28 rows of pad each side
    assert padded.shape == (3, 224, 224)
    assert padded[:, :28].abs().max().item() == 0.0 and padded[:, 196:].abs().max().item() == 0.0
    red = (200 / 255 - IMAGENET["image_mean"][0]) / IMAGENET["image_std"][0]
    assert abs(padded[0, 28:196].mean().item() - red) < 1e-4
    assert pre.min_decode_size("pad", None, (1200, 1600)) == (224, 168)
    tall = pre(Image.new("RGB", (100, 400), (200, 30, 30)), policy="pad", size=(224, 448)).pixel_values
    assert tall.shape == (3, 224, 448)
    assert tall[:, :, :168].abs().max().item() == 0.0 and tall[:, :, 224 + 56 :].abs().max().item() == 0.0


def test_pad_fill_is_the_mean_colour_without_normalisation() -> None:
    d = json.loads(FAMILIES["siglip"][0]().to_json_string()) | {"do_normalize": False}
    pre = Preprocessor(PreprocessConfig.from_processor_dict(d), (16, 16), (14, 14))
    out = pre(Image.new("RGB", (64, 32)), policy="pad").pixel_values
    assert torch.allclose(out[:, 0, 0], torch.tensor([0.5, 0.5, 0.5]))


# --- errors ------------------------------------------------------------------------------------------


def test_size_errors_name_the_nearest_multiples_and_dynamic() -> None:
    pre, img = dinov2(), Image.new("RGB", (300, 300))
    with pytest.raises(SizeError, match=r"height 225 \(nearest multiples of 14: 224 or 238\)") as info:
        pre(img, policy="squash", size=(225, 224))
    assert 'policy="dynamic"' in str(info.value) and info.value.code == "invalid_size"
    with pytest.raises(SizeError, match=r"width 300 .*294 or 308"):
        pre(img, policy="pad", size=(224, 300))
    with pytest.raises(SizeError, match=r"crop.*requested size"):
        pre(img, policy="crop", size=(230, 224))
    so400m = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 384, "width": 384}}
    siglip_384 = Preprocessor(PreprocessConfig.from_processor_dict(so400m), (14, 14), (27, 27))
    with pytest.raises(SizeError, match=r"SiglipImageProcessor checkpoint's size 384x384.*378 or 392"):
        siglip_384(img)
    assert siglip_384(img, policy="dynamic").grid == (27, 27)  # the suggested way out works
    for bad in [(0, 224), (224, -14), (8200, 224), (224.0, 224)]:
        with pytest.raises(SizeError):
            pre(img, policy="squash", size=bad)  # type: ignore[arg-type]
    with pytest.raises(SizeError, match="no whole 14x14 patch"):
        pre(img, policy="dynamic", size=(10, 10))


def test_invalid_options() -> None:
    pre = dinov2()
    with pytest.raises(InvalidOptionError, match="policy"):
        pre(Image.new("RGB", (8, 8)), policy="zoom")  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError):
        pre("not an image")  # type: ignore[arg-type]
    with pytest.raises(ImageDecodeError) as info:
        pre(b"")
    assert info.value.code == "empty"


def test_non_rgb_pil_input_is_composited() -> None:
    rgba = Image.new("RGBA", (224, 224), (255, 0, 0, 0))  # red, fully transparent → white
    out = dinov2()(rgba).pixel_values
    white = (1.0 - IMAGENET["image_mean"][0]) / IMAGENET["image_std"][0]
    assert abs(out[0].mean().item() - white) < 1e-5


# --- batching, draft ---------------------------------------------------------------------------------


def test_stack() -> None:
    pre, img = dinov2(), Image.new("RGB", (50, 40), (1, 2, 3))
    batch, grid = stack([pre(img), pre(img, policy="pad")])
    assert batch.shape == (2, 3, 224, 224) and grid == (16, 16)
    with pytest.raises(InvalidOptionError, match="different grids"):
        stack([pre(img), pre(img, policy="dynamic", size=(448, 448))])
    with pytest.raises(InvalidOptionError):
        stack([])
    assert isinstance(pre(img), Prepared)


def test_draft_on_and_off_agree_closely() -> None:
    data = jpeg_bytes(1600, 1200)
    pre = dinov2()
    policies: tuple[ResizePolicy, ...] = ("crop", "dynamic")
    for policy in policies:
        on = pre(data, policy=policy)
        off = pre(data, policy=policy, draft=False)
        assert on.pixel_values.shape == off.pixel_values.shape and on.grid == off.grid
        assert on.source_size == off.source_size == (1200, 1600)
        assert (on.pixel_values - off.pixel_values).abs().mean().item() < 0.05


def _bordered(
    photo: Image.Image, margins: tuple[int, int, int, int], colour: tuple[int, int, int]
) -> Image.Image:
    left, top, right, bottom = margins
    canvas = Image.new("RGB", (photo.width + left + right, photo.height + top + bottom), colour)
    canvas.paste(photo, (left, top))
    return canvas


def test_trim_box_finds_the_photo_inside_a_border_with_a_title_bar(images: dict[str, Image.Image]) -> None:
    from PIL import ImageDraw

    from vit_backbone.borders import trim_borders, trim_box

    photo = images["coffee"].resize((160, 120))
    boxed = _bordered(photo, (30, 44, 12, 20), (255, 255, 255))
    ImageDraw.Draw(boxed).rectangle((0, 0, boxed.width, 18), fill=(40, 40, 60))  # screenshot-style bar
    assert trim_box(boxed) == (30, 44, 190, 164)
    # through a JPEG round trip the border is noisy and the photo's edge rings within its 8x8 (chroma 16x16)
    # blocks: the box keeps at most a block of border per side, never cuts into the photo
    jpeg = io.BytesIO()
    boxed.save(jpeg, format="JPEG", quality=75)
    noisy = trim_box(Image.open(jpeg).convert("RGB"))
    assert noisy is not None and noisy[0] <= 30 and noisy[1] <= 44 and noisy[2] >= 190 and noisy[3] >= 164
    assert max(abs(a - b) for a, b in zip(noisy, (30, 44, 190, 164), strict=True)) <= 8
    assert trim_box(photo) is None and trim_borders(photo) is photo
    assert trim_box(Image.new("RGB", (50, 40), (7, 7, 7))) is None  # blank: nothing but border, left alone


def test_trim_policies_embed_the_photo_not_its_border(images: dict[str, Image.Image]) -> None:
    pre = dinov2()
    photo = images["chelsea"].resize((200, 140))
    boxed = _bordered(photo, (40, 10, 90, 60), (0, 0, 0))
    for policy in ("trim_squash", "trim_pad"):
        a, b = pre(photo, policy=policy), pre(boxed, policy=policy)  # type: ignore[arg-type]
        assert torch.equal(a.pixel_values, b.pixel_values) and a.grid == b.grid and b.policy == policy
    assert torch.equal(
        pre(boxed, policy="trim_squash").pixel_values, pre(photo, policy="squash").pixel_values
    )
    padded = pre(boxed, policy="trim_pad")
    assert padded.valid is not None and padded.valid.shape == (16, 16)  # the trimmed photo's letterbox
    assert np.array_equal(padded.valid, pre(photo, policy="pad").validity())
    encoded = io.BytesIO()
    boxed.save(encoded, format="PNG")
    from_bytes = pre(encoded.getvalue(), policy="trim_squash")  # draft is off for trim policies
    assert torch.equal(from_bytes.pixel_values, pre(photo, policy="squash").pixel_values)
