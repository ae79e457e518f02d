"""``choose_autocast``: the one precision rule shared by the server and the catalog job — explicit settings
honoured, ``auto`` = bfloat16 only where native, close to float32 (cosine ≥ 0.999) and not > 1.25x slower,
each precision warmed up at the timed batch size before it is timed."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vit_backbone import Backbone, load_backbone
from vit_backbone.precision import SLOWER_VETO, choose_autocast

IMAGES = [Image.new("RGB", (40 + 8 * k, 30 + 5 * k), (20 * k, 90, 200 - 15 * k)) for k in range(5)]


@pytest.fixture
def backbone(tiny_checkpoints: dict[str, Path]) -> Backbone:
    return load_backbone(tiny_checkpoints["dinov2"])


def spy(
    backbone: Backbone,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Any, np.ndarray], np.ndarray] | None = None,
) -> list[tuple[Any, int, int]]:
    """Record (autocast, batch_size, images) per ``embed`` call; ``change`` may alter what bf16 returns."""
    calls: list[tuple[Any, int, int]] = []
    real = backbone.embed

    def embed(images: Any, **options: Any) -> np.ndarray:
        calls.append((backbone.autocast, options["batch_size"], len(images)))
        vectors = real(images, **options)
        return vectors if change is None or backbone.autocast is None else change(options, vectors)

    monkeypatch.setattr(backbone, "embed", embed)
    return calls


def test_explicit_settings_are_honoured(backbone: Backbone, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy(backbone, monkeypatch)
    plain = choose_autocast(backbone, "float32", IMAGES)
    assert (plain.dtype, plain.label, plain.min_cosine, plain.seconds) == (None, "float32", None, None)
    assert calls == []  # nothing to measure
    with pytest.raises(ValueError, match="'float16' needs a CUDA device"):
        choose_autocast(backbone, "float16", IMAGES)
    with pytest.raises(ValueError, match="precision must be one of auto, float32, bfloat16, float16"):
        choose_autocast(backbone, "int8", IMAGES)
    # an explicit bfloat16 is kept even where it is not native or slower; its cosine is reported
    forced = choose_autocast(backbone, "bfloat16", IMAGES, native_bf16=False, pooling="mean")
    assert forced.dtype is torch.bfloat16 and forced.label == "bfloat16"
    assert forced.min_cosine is not None and 0.99 < forced.min_cosine <= 1.0 + 1e-6
    assert forced.describe() == f"bfloat16 autocast (min cosine {forced.min_cosine:.5f} to float32)"
    assert backbone.autocast is None  # restored: the caller applies the choice


def test_auto_without_native_bf16_is_float32_without_probing(
    backbone: Backbone, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy(backbone, monkeypatch)
    choice = choose_autocast(backbone, "auto", IMAGES, native_bf16=False)
    assert (choice.dtype, choice.label, choice.min_cosine) == (None, "float32", None)
    assert calls == []


def test_auto_probe_warms_up_each_precision_at_the_timed_batch_size(
    backbone: Backbone, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = spy(backbone, monkeypatch)
    choice = choose_autocast(backbone, "auto", IMAGES, batch_size=4, native_bf16=True)
    n = len(IMAGES)
    bf16 = torch.bfloat16
    assert calls == [(None, 4, n), (None, 4, n), (bf16, 4, n), (bf16, 4, n)]  # warm-up, timed; warm-up, timed
    assert choice.seconds is not None and choice.min_cosine is not None
    fp32_s, low_s = choice.seconds
    keep = choice.min_cosine >= 0.999 and low_s <= SLOWER_VETO * fp32_s
    assert choice.label == ("bfloat16" if keep else "float32")
    assert backbone.autocast is None


def test_auto_drops_bfloat16_when_clearly_slower(backbone: Backbone, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(options: Any, vectors: np.ndarray) -> np.ndarray:
        time.sleep(0.3)  # far over 1.25x a tiny model's float32 pass
        return vectors

    spy(backbone, monkeypatch, slow)
    choice = choose_autocast(backbone, "auto", IMAGES, native_bf16=True)
    assert choice.label == "float32" and choice.dtype is None
    assert choice.seconds is not None and choice.seconds[1] > SLOWER_VETO * choice.seconds[0]
    # the same slowness does not override an explicit request
    assert choose_autocast(backbone, "bfloat16", IMAGES, native_bf16=True).label == "bfloat16"


def test_auto_drops_bfloat16_when_vectors_drift(backbone: Backbone, monkeypatch: pytest.MonkeyPatch) -> None:
    def drift(options: Any, vectors: np.ndarray) -> np.ndarray:
        return vectors + np.random.default_rng(0).normal(0, vectors.std() * 0.2, vectors.shape)  # cos ≈ 0.98

    spy(backbone, monkeypatch, drift)
    choice = choose_autocast(backbone, "auto", IMAGES, native_bf16=True)
    assert choice.label == "float32" and choice.min_cosine is not None and choice.min_cosine < 0.999
