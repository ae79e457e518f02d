"""The dense head: masks reduced to the patch grid by area vote, and a generated segmentation task (a red
square and a blue disc on a textured background) learned far above the majority-class baseline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from heads_synthetic import SEG_CLASSES, make_segmentation_folder, segmentation_pair
from PIL import Image

from vit_backbone import Backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.heads import PatchHead, TrainOptions, load_head, save_head, train_head
from vit_backbone.heads.data import read_segmentation_folder
from vit_backbone.heads.patch import IGNORE, mask_to_grid, patch_ids, place_mask, segmentation_score
from vit_backbone.heads.predict import predict_masks

SIZE = (112, 112)  # an 8x8 grid of 14 px patches


def test_mask_to_grid_area_vote() -> None:
    mask = np.asarray(
        [
            [1, 1, 2, 2],
            [1, 1, 2, 0],
            [255, 1, 255, 255],
            [255, 1, 255, 255],
        ]
    )
    grid = mask_to_grid(mask, (2, 2), num_classes=3)
    # top-left all 1; top-right 3 of 4 are 2; bottom-left half ignored -> ignored; bottom-right all ignored
    assert grid.tolist() == [[1, 2], [-1, -1]]
    with pytest.raises(InvalidOptionError, match=r"mask values must be 0..2 or 255"):
        mask_to_grid(np.full((4, 4), 7), (2, 2), num_classes=3)


@pytest.fixture(scope="module")
def patch_head(tiny: Backbone, seg_folder: Path) -> PatchHead:
    head = train_head(tiny, seg_folder, TrainOptions(kind="patch", size=SIZE)).head
    assert isinstance(head, PatchHead)
    return head


def majority_baseline(masks: list[np.ndarray]) -> float:
    counts = np.bincount(np.concatenate([m.ravel() for m in masks]))
    return float(counts.max() / counts.sum())


def test_patch_head_learns_the_segmentation_task(
    patch_head: PatchHead, tiny: Backbone, seg_folder: Path
) -> None:
    card = patch_head.card
    assert (card.kind, card.pooling, card.layers, card.policy, card.size) == (
        "patch",
        "patch",
        None,
        "squash",
        SIZE,
    )
    assert card.classes == SEG_CLASSES
    assert (card.train_count, card.val_count) == (24, 6)
    dataset = read_segmentation_folder(seg_folder)
    baseline = majority_baseline([np.asarray(Image.open(m)) for m in dataset.masks])
    assert card.val_accuracy is not None and card.val_miou is not None
    assert card.val_accuracy >= baseline + 0.1, (card.val_accuracy, baseline)
    assert card.val_miou >= 0.6
    # unseen images, predicted through the Python API at the input size
    pairs = [segmentation_pair(50_000 + i) for i in range(8)]
    images = [image for image, _ in pairs]
    truths = [mask for _, mask in pairs]
    predicted = predict_masks(tiny, patch_head, images, upsample=True)
    assert [p.shape for p in predicted] == [(112, 112)] * 8
    score = segmentation_score(predicted, truths, 3)
    fresh_baseline = majority_baseline(truths)
    assert score.pixel_accuracy >= fresh_baseline + 0.1, (score, fresh_baseline)
    assert score.miou >= 0.6 > fresh_baseline / 3  # the baseline's mIoU: one class of three, at best
    grids = predict_masks(tiny, patch_head, images[:2])
    assert [g.shape for g in grids] == [(8, 8)] * 2
    nearest = predict_masks(tiny, patch_head, images[:1], upsample=True, mode="nearest")[0]
    np.testing.assert_array_equal(nearest, np.kron(grids[0], np.ones((14, 14), dtype=np.int64)))


def test_upsampling_goes_to_each_input_size(patch_head: PatchHead, tiny: Backbone) -> None:
    image, _ = segmentation_pair(7, height=90, width=150)
    [mask] = predict_masks(tiny, patch_head, [image], upsample=True)
    assert mask.shape == (90, 150)
    assert set(np.unique(mask).tolist()) <= {0, 1, 2}


def test_round_trip_and_refusals(patch_head: PatchHead, tiny: Backbone, tmp_path: Path) -> None:
    save_head(patch_head, tmp_path / "seg")
    loaded = load_head(tmp_path / "seg", tiny)
    assert loaded.card == patch_head.card
    image, _ = segmentation_pair(3)
    np.testing.assert_array_equal(
        predict_masks(tiny, loaded, [image])[0], predict_masks(tiny, patch_head, [image])[0]
    )
    folder = make_segmentation_folder(tmp_path / "data", count=4, names=False)
    for policy in ("crop", "trim_pad", "trim_squash"):
        with pytest.raises(InvalidOptionError, match=rf"{policy!r} crops or trims it, so masks would not"):
            train_head(tiny, folder, TrainOptions(kind="patch", policy=policy))
    assert read_segmentation_folder(folder).classes == ("0", "1", "2")
    (folder / "000.mask.png").unlink()
    with pytest.raises(InvalidOptionError, match=r"1 image\(s\) have no mask beside them \(e.g. 000.png\)"):
        read_segmentation_folder(folder)
    Image.new("L", (50, 50)).save(folder / "000.mask.png")
    with pytest.raises(InvalidOptionError, match=r"mask of .*000.png is 50x50, the image 112x112"):
        train_head(tiny, folder, TrainOptions(kind="patch"))


# ------------------------------------------------------------------------------------------------ pad
def test_place_mask_and_letterbox_ids() -> None:
    mask = np.asarray([[1, 2], [0, 1]], dtype=np.uint8)
    canvas = place_mask(mask, (6, 4), (1, 0, 4, 4))  # the image is rows 1-4 of a 6x4 tensor
    assert canvas.tolist() == [
        [255, 255, 255, 255],
        [1, 1, 2, 2],
        [1, 1, 2, 2],
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [255, 255, 255, 255],
    ]
    assert place_mask(mask, (2, 2), None) is mask
    import torch

    logits = torch.zeros(3, 2, 2)  # [h, w, C]: 3x2 patches of 2 px, the image on rows 1..4 of 6
    logits[..., 1] = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    ids = patch_ids(logits, patch=(2, 2), box=(1, 0, 4, 4))
    # patch rows 0 and 2 are half image (pixel rows 1 and 4): kept, a patch less than half image is not
    assert ids.tolist() == [[0, 0], [1, 0], [1, 1]]
    ids = patch_ids(logits, patch=(2, 2), box=(2, 0, 2, 4))  # the image only on pixel rows 2-3
    assert ids.tolist() == [[IGNORE, IGNORE], [1, 0], [IGNORE, IGNORE]]
    ids = patch_ids(logits, patch=(2, 2), box=(3, 0, 2, 4))  # rows 3-4: two patch rows half image each
    assert ids.tolist() == [[IGNORE, IGNORE], [1, 0], [1, 1]]
    nearest = patch_ids(logits, patch=(2, 2), box=(2, 0, 2, 4), upsample_to=(4, 8), mode="nearest")
    assert nearest.tolist() == [[1] * 4 + [0] * 4] * 4  # only the middle patch row, resized to 4x8
    assert patch_ids(logits, patch=(2, 2), box=None, upsample_to=(6, 4)).shape == (6, 4)


def test_pad_policy_trains_on_image_patches_and_predicts_masks_of_the_image(
    tiny: Backbone, tmp_path: Path
) -> None:
    """Wide images letterboxed into a square: the head learns from the image's patches only, its grids
    mark the letterbox 255, and upsampled masks cover exactly the image."""
    folder = make_segmentation_folder(tmp_path / "wide", count=30, size=(112, 224))
    head = train_head(tiny, folder, TrainOptions(kind="patch", policy="pad", size=(224, 224))).head
    assert isinstance(head, PatchHead) and head.card.policy == "pad"
    assert head.card.val_miou is not None and head.card.val_miou >= 0.6
    pairs = [segmentation_pair(60_000 + i, 112, 224) for i in range(6)]
    images, truths = [p[0] for p in pairs], [p[1] for p in pairs]
    masks = predict_masks(tiny, head, images, upsample=True)
    assert [m.shape for m in masks] == [(112, 224)] * 6
    score = segmentation_score(masks, truths, 3)
    assert score.miou >= 0.6, score
    grids = predict_masks(tiny, head, images[:1])
    # 224x112 in the 224x224 box: 8 image rows of 14 px centred (rows 4-11 of 16), the rest 255
    grid = grids[0]
    assert grid.shape == (16, 16)
    assert (grid[:4] == IGNORE).all() and (grid[12:] == IGNORE).all()
    assert (grid[4:12] != IGNORE).all()
