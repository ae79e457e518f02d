"""Backbone.pooled_many: several poolings from one forward pass, equal to separate pooled() calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from vit_backbone import Backbone
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
