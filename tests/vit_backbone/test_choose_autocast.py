"""``choose_autocast``: the one precision rule shared by the server and the catalog job — explicit settings
honoured, ``auto`` = bfloat16 only where native, close to float32 (cosine ≥ 0.999) and not > 1.25x slower,
each precision warmed up at the timed batch size before it is timed."""

from __future__ import annotations

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


class ScriptedClock:
    """A clock that reads the given times in order: the probe's two timed passes take exactly what the
    test says, whatever the machine is doing."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0)


def passes(fp32_s: float, low_s: float) -> ScriptedClock:
    """Readings for a float32 pass of ``fp32_s`` seconds, then a low-precision pass of ``low_s``."""
    return ScriptedClock(0.0, fp32_s, 100.0, 100.0 + low_s)


def at_cosine(target: float) -> Callable[[Any, np.ndarray], np.ndarray]:
    """A low-precision output whose every row has exactly cosine ``target`` to the float32 row: the row plus
    an orthogonal component of |row|·tan(θ)."""

    def change(options: Any, vectors: np.ndarray) -> np.ndarray:
        rows = vectors.reshape(len(vectors), -1).astype(np.float64)  # [N, F]
        noise = np.random.default_rng(0).normal(size=rows.shape)
        noise -= (noise * rows).sum(1, keepdims=True) / (rows * rows).sum(1, keepdims=True) * rows
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        tangent = np.tan(np.arccos(target)) * np.linalg.norm(rows, axis=1, keepdims=True)
        return (rows + tangent * noise).reshape(vectors.shape)

    return change


def spy(
    backbone: Backbone,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Any, np.ndarray], np.ndarray] | None = None,
) -> list[tuple[Any, int, int]]:
    """Record (autocast, batch_size, images) per ``embed`` call; the low-precision passes return the float32
    vectors (cosine 1), or ``change`` of them."""
    calls: list[tuple[Any, int, int]] = []
    real = backbone.embed

    def embed(images: Any, **options: Any) -> np.ndarray:
        calls.append((backbone.autocast, options["batch_size"], len(images)))
        autocast, backbone.autocast = backbone.autocast, None
        try:
            vectors = real(images, **options)  # float32 in every pass: a known reference
        finally:
            backbone.autocast = autocast
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
    # an explicit bfloat16 is kept even where it is not native, slower and drifting; its cosine is reported
    spy(backbone, monkeypatch, at_cosine(0.99))
    forced = choose_autocast(
        backbone, "bfloat16", IMAGES, native_bf16=False, pooling="mean", clock=passes(1.0, 3.0)
    )
    assert forced.dtype is torch.bfloat16 and forced.label == "bfloat16"
    assert forced.min_cosine == pytest.approx(0.99, abs=1e-9)
    assert forced.seconds == pytest.approx((1.0, 3.0))
    assert forced.describe() == "bfloat16 autocast (min cosine 0.99000 to float32)"
    assert backbone.autocast is None  # restored: the caller applies the choice


def test_real_bfloat16_vectors_stay_close_to_float32(backbone: Backbone) -> None:
    forced = choose_autocast(backbone, "bfloat16", IMAGES, native_bf16=False, pooling="mean")
    assert forced.min_cosine is not None and 0.99 < forced.min_cosine <= 1.0 + 1e-6


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
    clock = passes(1.0, 0.5)
    choice = choose_autocast(backbone, "auto", IMAGES, batch_size=4, native_bf16=True, clock=clock)
    n = len(IMAGES)
    bf16 = torch.bfloat16
    assert calls == [(None, 4, n), (None, 4, n), (bf16, 4, n), (bf16, 4, n)]  # warm-up, timed; warm-up, timed
    assert clock.readings == []  # exactly the two timed passes were timed
    assert (choice.label, choice.dtype, choice.seconds) == ("bfloat16", bf16, pytest.approx((1.0, 0.5)))
    assert backbone.autocast is None


@pytest.mark.parametrize(
    ("fp32_s", "low_s", "cosine", "label"),
    [
        (1.0, 0.5, 1.0, "bfloat16"),  # faster and equal
        (1.0, SLOWER_VETO, 1.0, "bfloat16"),  # exactly 1.25x float32's time is still kept
        (1.0, SLOWER_VETO + 0.01, 1.0, "float32"),  # clearly slower: dropped
        (2.0, 2.4, 0.9991, "bfloat16"),  # a little slower, within the cosine bound
        (2.0, 1.0, 0.9989, "float32"),  # faster, but drifts past cosine 0.999
    ],
)
def test_auto_rule_on_given_timings_and_cosines(
    backbone: Backbone,
    monkeypatch: pytest.MonkeyPatch,
    fp32_s: float,
    low_s: float,
    cosine: float,
    label: str,
) -> None:
    spy(backbone, monkeypatch, None if cosine == 1.0 else at_cosine(cosine))
    choice = choose_autocast(backbone, "auto", IMAGES, native_bf16=True, clock=passes(fp32_s, low_s))
    assert choice.label == label
    assert choice.dtype is (torch.bfloat16 if label == "bfloat16" else None)
    assert choice.min_cosine == pytest.approx(cosine, abs=1e-9)
    assert choice.seconds == pytest.approx((fp32_s, low_s))
    # the same timings and drift do not override an explicit request
    explicit = choose_autocast(backbone, "bfloat16", IMAGES, native_bf16=True, clock=passes(fp32_s, low_s))
    assert explicit.label == "bfloat16"
