"""Named presets: what each resolves to, and a preset's box (``size``) reaching every embed path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_backbone import InvalidOptionError, load_backbone
from vit_backbone.presets import DEFAULT_PRESET, PRESETS, embedded_defaults, resolve_presets


def test_the_current_default_is_default_v3_and_the_old_ones_stay() -> None:
    assert DEFAULT_PRESET == "default-v3"
    assert list(PRESETS) == ["default-v1", "default-v2", "default-v3"]
    assert embedded_defaults() == {
        "pooling": "cls_mean_hflip",
        "layers": [8],
        "policy": "trim_squash",
        "size": [98, 98],
    }
    assert embedded_defaults("default-v2") == {
        "pooling": "mean",
        "layers": [8],
        "policy": "trim_squash",
        "size": None,
    }


def test_only_the_embedded_backbone_takes_a_presets_box() -> None:
    embedded = resolve_presets(embedded=True, family_pooling="cls", has_projection=False, declared=None)
    assert embedded["default-v3"].size == (98, 98) and embedded["default-v2"].size is None
    other = resolve_presets(embedded=False, family_pooling="cls", has_projection=False, declared=None)
    assert all(d.size is None for d in other.values())
    declared = resolve_presets(
        embedded=False, family_pooling="cls", has_projection=False, declared={"size": [42, 28]}
    )
    assert all(d.size == (42, 28) for d in declared.values())
    with pytest.raises(InvalidOptionError, match=r"defaults.size must be \[h, w\] integers or null"):
        resolve_presets(embedded=False, family_pooling="cls", has_projection=False, declared={"size": 56})


@pytest.fixture(scope="module")
def boxed(make_checkpoint: Callable[..., Path]) -> Path:
    """A tiny DINOv2 (native 56x56, a 4x4 grid) whose vitembed.json declares a 28x28 box."""
    folder = make_checkpoint("dinov2", seed=3)
    defaults = {"pooling": "mean_hflip", "layers": [1], "policy": "squash", "size": [28, 28]}
    (folder / "vitembed.json").write_text(json.dumps({"defaults": defaults}))
    return folder


def test_a_declared_box_is_used_when_no_size_is_asked_for(
    boxed: Path, sample_images: list[Image.Image]
) -> None:
    bb = load_backbone(boxed)
    result = bb.embed_result(sample_images[:2])
    assert (result.pooling, result.size, result.grids) == ("mean_hflip", (28, 28), [(2, 2), (2, 2)])
    explicit = bb.embed(sample_images[:2], size=28)
    np.testing.assert_allclose(result.vectors, explicit, rtol=0, atol=1e-6)
    native = bb.embed_result(sample_images[:2], size=56)
    assert native.grids == [(4, 4), (4, 4)] and native.size == (56, 56)
    assert np.abs(native.vectors - result.vectors).max() > 1e-3  # the box changes the vectors
    assert [p.grid for p in bb.prepare(sample_images[:1])] == [(2, 2)]  # prepare takes the box too


def test_dense_output_keeps_the_native_box(boxed: Path, sample_images: list[Image.Image]) -> None:
    bb = load_backbone(boxed)
    patch = bb.embed_result(sample_images[:1], pooling="patch")
    assert patch.size is None and patch.grids == [(4, 4)] and patch.vectors.shape[1:3] == (4, 4)
    asked = bb.embed_result(sample_images[:1], pooling="patch", size=28)
    assert asked.size == (28, 28) and asked.grids == [(2, 2)]
