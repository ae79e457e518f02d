"""Heads on the backbone's device, the precision and position rule on the card, and bfloat16 parity.

No accelerator here: the ``meta`` device stands in for one (any non-CPU device takes the same path; a
tensor left on the CPU next to meta features makes the op fail, as it would on CUDA).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from vitembed.engine.served_heads import bind_heads

from vit_backbone import Backbone, load_backbone
from vit_backbone.heads import (
    Head,
    HeadCard,
    HeadMismatchError,
    TrainOptions,
    load_head,
    save_head,
    train_head,
)
from vit_backbone.heads.predict import predict_proba

META = torch.device("meta")
# Measured on the tiny random-init DINOv2 over the 24 fresh images: max |p_bf16 - p_fp32| = 3.4e-4 for the
# linear head, 1.2e-5 for kNN (argmax always equal); the tolerance leaves a ~6x margin.
BF16_ATOL = 2e-3


@pytest.fixture(scope="module")
def saved(tiny: Backbone, labelled_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    heads = {
        "linear": train_head(tiny, labelled_folder, TrainOptions(kind="linear", pooling="mean")).head,
        "knn": train_head(tiny, labelled_folder, TrainOptions(kind="knn", pooling="mean")).head,
    }
    paths = {}
    for kind, head in heads.items():
        paths[kind] = root / f"{kind}.safetensors"
        save_head(head, paths[kind])
    return paths


@pytest.fixture(scope="module")
def patch_path(tiny: Backbone, seg_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    head = train_head(tiny, seg_folder, TrainOptions(kind="patch", size=(56, 56))).head
    path = tmp_path_factory.mktemp("patch") / "seg.safetensors"
    save_head(head, path)
    return path


@pytest.mark.parametrize("kind", ["linear", "knn", "patch"])
def test_to_moves_every_tensor_and_predicts_there(
    kind: str, saved: dict[str, Path], patch_path: Path
) -> None:
    head = load_head(patch_path if kind == "patch" else saved[kind])
    moved = head.to(META)
    assert {name: t.device for name, t in moved.tensors().items()} == dict.fromkeys(head.tensors(), META)
    assert all(t.device.type == "cpu" for t in head.tensors().values())  # a copy: the original stays
    shape = (2, 4, 4, 32) if kind == "patch" else (2, 32)
    out = moved.predict_proba(torch.empty(shape, device=META))
    assert out.device == META and tuple(out.shape) == (*shape[:-1], head.card.num_classes)
    features = torch.randn(shape)  # and on the same device, the same numbers
    torch.testing.assert_close(
        head.to("cpu").predict_proba(features), head.predict_proba(features), atol=0, rtol=0
    )


def test_bind_moves_heads_to_the_backbone_device(
    saved: dict[str, Path], tiny_checkpoints: dict[str, Path]
) -> None:
    backbone = load_backbone(tiny_checkpoints["dinov2"])
    backbone.model.to(META)  # as if served on an accelerator
    bound = bind_heads({name: str(path) for name, path in saved.items()}, {"tiny": backbone})
    for name in saved:
        assert {t.device for t in bound[name].head.tensors().values()} == {META}, name


def test_card_records_precision_and_interpolation(saved: dict[str, Path], tiny: Backbone) -> None:
    card = load_head(saved["linear"]).card
    assert (card.precision, card.interpolation) == ("float32", "transformers")
    old = {k: v for k, v in card.to_dict().items() if k not in ("precision", "interpolation")}
    assert HeadCard.from_dict(old).precision is None  # cards written before these fields still load
    assert HeadCard.from_dict(old).interpolation is None


def test_another_position_rule_is_refused(saved: dict[str, Path], tiny_checkpoints: dict[str, Path]) -> None:
    other = load_backbone(tiny_checkpoints["dinov2"], interpolation="antialias")
    with pytest.raises(HeadMismatchError, match=r"interpolation transformers != antialias"):
        load_head(saved["linear"], other)


def test_bind_warns_when_the_served_precision_differs(
    saved: dict[str, Path], tiny_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    backbone = load_backbone(tiny_checkpoints["dinov2"], autocast=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="vitembed.engine.served_heads"):
        bind_heads({"lin": str(saved["linear"])}, {"tiny": backbone})
    assert [r.getMessage() for r in caplog.records] == [
        "head lin was trained on float32 features; model tiny serves them in bfloat16, so its probabilities "
        "differ slightly from the training-time ones (start with --precision float32 for exact parity)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitembed.engine.served_heads"):
        bind_heads({"lin": str(saved["linear"])}, {"tiny": load_backbone(tiny_checkpoints["dinov2"])})
    assert caplog.records == []


@pytest.mark.parametrize("kind", ["linear", "knn"])
def test_bfloat16_features_keep_the_argmax_and_probabilities_close(
    kind: str, saved: dict[str, Path], fresh_folder: Path, tiny_checkpoints: dict[str, Path], tiny: Backbone
) -> None:
    images = [p.read_bytes() for p in sorted(fresh_folder.rglob("*.png"))]
    head: Head = load_head(saved[kind])
    exact = predict_proba(tiny, head, images)  # float32, as trained
    low = predict_proba(load_backbone(tiny_checkpoints["dinov2"], autocast=torch.bfloat16), head, images)
    assert (low.argmax(1) == exact.argmax(1)).all()
    difference = float(np.abs(low - exact).max())
    assert 0 < difference < BF16_ATOL  # it does differ (bfloat16 ran), and only a little
