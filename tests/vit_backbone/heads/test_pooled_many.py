"""Backbone.pooled_many: several poolings from one forward pass, equal to separate pooled() calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from vit_backbone import Backbone, load_backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.preprocess import stack


@contextmanager
def count_forwards(backbone: Backbone) -> Iterator[list[int]]:
    """Counts calls of the model itself (a pre-hook: early exit skips the model's post-hooks)."""
    calls = [0]

    def hook(module: Any, args: Any) -> None:
        calls[0] += 1

    handle = backbone.model.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def pixels(tiny: Backbone, sample_images: list[Any]) -> torch.Tensor:
    return stack(tiny.prepare(sample_images[:3], policy="squash", size=(56, 84)))[0]  # [3, 3, 56, 84]


REQUESTS: list[tuple[Any, Any]] = [
    ("cls", None),
    ("mean", [0]),
    ("linear_eval", [0, 1]),
    ("patch", [1]),
    ("gem", [0, 1]),
    ("cls_mean", None),
]


FAMILIES = ("dinov2", "dinov2_registers", "dinov3", "vit", "clip", "siglip")


@pytest.fixture(scope="module")
def family_backbones(tiny_checkpoints: dict[str, Path]) -> dict[str, Backbone]:
    assert tuple(tiny_checkpoints) == FAMILIES  # every family tests/conftest.py makes
    return {family: load_backbone(path) for family, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_separate_pooled_calls_in_one_forward(
    family: str, family_backbones: dict[str, Backbone], sample_images: list[Any]
) -> None:
    """All six families, with the model's own pooler where it has one (vit, clip, siglip)."""
    bb = family_backbones[family]
    pixels = stack(bb.prepare(sample_images[:2], policy="squash"))[0]  # [2, 3, H, W]
    requests: list[tuple[Any, Any]] = [("mean", [0]), ("patch", [1]), ("gem", None), ("mean", None)]
    if bb.spec.has_cls:
        requests += [("cls", None), ("linear_eval", [0, 1]), ("cls_mean", [0])]
    if family in ("vit", "clip", "siglip"):
        requests.append(("pooler", None))
    separate = [bb.pooled(pixels, pooling, layers) for pooling, layers in requests]
    with count_forwards(bb) as calls:
        together = bb.pooled_many(pixels, requests)
    assert calls[0] == 1
    for mine, theirs in zip(together, separate, strict=True):
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_equals_separate_pooled_calls_in_one_forward(tiny: Backbone, pixels: torch.Tensor) -> None:
    separate = [tiny.pooled(pixels, pooling, layers) for pooling, layers in REQUESTS]
    with count_forwards(tiny) as calls:
        together = tiny.pooled_many(pixels, REQUESTS)
    assert calls[0] == 1
    assert [tuple(t.shape) for t in together] == [tuple(t.shape) for t in separate]
    for mine, theirs in zip(together, separate, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_with_the_pooler_still_one_forward(tiny: Backbone, pixels: torch.Tensor) -> None:
    requests: list[tuple[Any, Any]] = [("pooler", None), ("mean", [0])]
    with count_forwards(tiny) as calls:
        together = tiny.pooled_many(pixels, requests)
    assert calls[0] == 1
    torch.testing.assert_close(together[0], tiny.pooled(pixels, "pooler", None), atol=1e-6, rtol=0)
    torch.testing.assert_close(together[1], tiny.pooled(pixels, "mean", [0]), atol=1e-6, rtol=0)


def test_early_exit_at_the_deepest_requested_block(tiny: Backbone, pixels: torch.Tensor) -> None:
    ran: list[int] = []
    blocks = tiny.model.encoder.layer
    handles = [b.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, b in enumerate(blocks)]
    try:
        tiny.pooled_many(pixels, [("mean", [0]), ("cls", [0])])
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [0]  # block 1 never ran


def test_bad_requests_are_refused(tiny: Backbone, pixels: torch.Tensor) -> None:
    with pytest.raises(InvalidOptionError, match=r"at least one"):
        tiny.pooled_many(pixels, [])
    with pytest.raises(InvalidOptionError, match=r"layer 5 does not exist"):
        tiny.pooled_many(pixels, [("mean", [5])])
    with pytest.raises(InvalidOptionError, match=r"unknown pooling 'max'"):
        tiny.pooled_many(pixels, [("max", None)])  # type: ignore[list-item]
