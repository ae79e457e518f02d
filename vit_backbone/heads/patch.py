"""Dense head: one linear classifier applied to every patch token.

Training targets come from per-image masks (class id = pixel value, 255 = ignore). A mask is reduced to
the patch grid by area vote: the one-hot mask is average-pooled over each patch's share of the image and
the patch takes the class covering most of it; a patch more than half covered by ignore pixels is
ignored. ``squash`` and ``dynamic`` map the whole image onto the whole grid. ``pad`` letterboxes it: the
mask is placed where the image is (``place_mask``), the letterbox counts as ignore, so letterbox patches
never train the head, and predictions mark them ``IGNORE`` on the grid and are cropped to the image before
``upsample``. ``crop`` throws part of the image away and ``trim_*`` cut it where the pixels say, so a mask
would not line up: patch heads refuse them. Prediction gives class ids on the grid; ``upsample`` resizes
the logits bilinearly (or the ids by nearest neighbour) back to the input image's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidOptionError
from .base import as_float_tensor, l2_normalize
from .linear import fit_softmax
from .softmax import SoftmaxHead, SoftmaxParams

IGNORE = 255  # mask value that marks pixels without a class
PATCH_POLICIES: tuple[str, ...] = ("squash", "dynamic", "pad")
UpsampleMode = Literal["bilinear", "nearest"]


def check_patch_policy(policy: str) -> None:
    if policy not in PATCH_POLICIES:
        raise InvalidOptionError(
            f"patch heads need a policy that keeps the whole image where masks can follow it "
            f"({', '.join(PATCH_POLICIES)}); {policy!r} crops or trims it, so masks would not line up"
        )


def mask_to_grid(mask: np.ndarray, grid: tuple[int, int], num_classes: int) -> torch.Tensor:
    """[H, W] class ids (IGNORE = no class) → [h, w] int64 by area vote; -1 where mostly ignored."""
    labels = torch.from_numpy(np.asarray(mask, dtype=np.int64))  # [H, W]
    valid = labels != IGNORE
    if bool((labels[valid] >= num_classes).any()) or bool((labels < 0).any()):
        raise InvalidOptionError(f"mask values must be 0..{num_classes - 1} or {IGNORE} (ignore)")
    onehot = F.one_hot(labels.clamp(0, num_classes - 1), num_classes).float()  # [H, W, C]
    onehot = onehot * valid[..., None]  # ignored pixels vote for nobody
    shares = F.adaptive_avg_pool2d(onehot.permute(2, 0, 1)[None], grid)[0]  # [C, h, w]
    best, ids = shares.max(dim=0)  # [h, w]
    covered = shares.sum(dim=0)  # [h, w] share of non-ignored pixels
    ids[(covered <= 0.5) | (best <= 0)] = -1
    return ids


Box = tuple[int, int, int, int]  # (top, left, height, width) of the image inside the letterbox, in pixels


def place_mask(mask: np.ndarray, out_hw: tuple[int, int], box: Box | None) -> np.ndarray:
    """[H, W] source mask → the mask of the tensor the model sees ([out_h, out_w]): resized (nearest) into
    ``box`` with IGNORE on the letterbox; unchanged when the image fills the tensor (``box`` None)."""
    if box is None:
        return mask
    from PIL import Image

    top, left, height, width = box
    canvas = np.full(out_hw, IGNORE, dtype=np.uint8)  # [out_h, out_w]
    source = Image.fromarray(np.asarray(mask, dtype=np.uint8))
    resized = source.resize((width, height), Image.Resampling.NEAREST)
    canvas[top : top + height, left : left + width] = np.asarray(resized)  # [height, width]
    return canvas


def patch_ids(
    logits: torch.Tensor,
    *,
    patch: tuple[int, int],
    box: Box | None,
    upsample_to: tuple[int, int] | None = None,
    mode: UpsampleMode = "bilinear",
) -> torch.Tensor:
    """[h, w, C] logits of one image → class ids: on the grid ([h, w], letterbox patches — less than half
    image — IGNORE), or at ``upsample_to`` (H, W), the image's own size, cropped to ``box`` first."""
    h, w = logits.shape[0], logits.shape[1]
    if upsample_to is None:
        ids = logits.argmax(dim=-1)  # [h, w]
        if box is not None:
            from ..preprocess import patch_coverage

            coverage = torch.from_numpy(patch_coverage((h, w), patch, box[:2], box[2:]))  # [h, w]
            ids[coverage < 0.5] = IGNORE
        return ids
    if box is None:
        return upsample_logits(logits, upsample_to, mode)
    top, left, height, width = box
    tensor_hw = (h * patch[0], w * patch[1])
    if mode == "nearest":
        ids = logits.argmax(dim=-1)[None, None].float()  # [1, 1, h, w]
        full = F.interpolate(ids, size=tensor_hw, mode="nearest")[0, 0]  # [H_t, W_t]
        crop = full[top : top + height, left : left + width][None, None]  # [1, 1, height, width]
        return F.interpolate(crop, size=upsample_to, mode="nearest")[0, 0].long()  # [H, W]
    if mode != "bilinear":
        raise InvalidOptionError(f"upsample mode must be 'bilinear' or 'nearest', got {mode!r}")
    full = F.interpolate(
        logits.permute(2, 0, 1)[None].float(), size=tensor_hw, mode="bilinear", align_corners=False
    )  # [1, C, H_t, W_t]
    crop = full[:, :, top : top + height, left : left + width]  # [1, C, height, width]
    big = F.interpolate(crop, size=upsample_to, mode="bilinear", align_corners=False)  # [1, C, H, W]
    return big[0].argmax(dim=0)  # [H, W]


def upsample_logits(
    logits: torch.Tensor, size: tuple[int, int], mode: UpsampleMode = "bilinear"
) -> torch.Tensor:
    """[h, w, C] logits → [H, W] class ids at ``size`` (H, W)."""
    if mode == "bilinear":
        big = F.interpolate(
            logits.permute(2, 0, 1)[None].float(), size=size, mode="bilinear", align_corners=False
        )
        return big[0].argmax(dim=0)  # [H, W]
    if mode == "nearest":
        ids = logits.argmax(dim=-1)[None, None].float()  # [1, 1, h, w]
        return F.interpolate(ids, size=size, mode="nearest")[0, 0].long()  # [H, W]
    raise InvalidOptionError(f"upsample mode must be 'bilinear' or 'nearest', got {mode!r}")


@dataclass(frozen=True)
class SegmentationScore:
    pixel_accuracy: float
    miou: float  # over classes present in the truth or the prediction
    iou: dict[int, float]


def segmentation_score(
    predictions: Sequence[torch.Tensor | np.ndarray], truths: Sequence[np.ndarray], num_classes: int
) -> SegmentationScore:
    """Pixel accuracy and mean IoU from a confusion matrix over all images (IGNORE pixels skipped)."""
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    for predicted, truth in zip(predictions, truths, strict=True):
        p = np.asarray(predicted, dtype=np.int64).ravel()
        t = np.asarray(truth, dtype=np.int64).ravel()
        keep = t != IGNORE
        confusion += np.bincount(t[keep] * num_classes + p[keep], minlength=num_classes**2).reshape(
            num_classes, num_classes
        )
    total = confusion.sum()
    inter = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - inter
    iou = {c: float(inter[c] / union[c]) for c in range(num_classes) if union[c] > 0}
    return SegmentationScore(
        pixel_accuracy=float(inter.sum() / total) if total else 0.0,
        miou=float(np.mean(list(iou.values()))) if iou else 0.0,
        iou=iou,
    )


@dataclass(frozen=True)
class PatchFit:
    params: SoftmaxParams
    weight_decay: float
    val_score: SegmentationScore | None
    tried: dict[str, float]


def _rows(
    features: Sequence[torch.Tensor | np.ndarray], masks: Sequence[np.ndarray], num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for feature, mask in zip(features, masks, strict=True):
        grid_features = as_float_tensor(feature)  # [h, w, F]
        if grid_features.dim() != 3:
            raise InvalidOptionError(
                f"patch features must be [h, w, F] per image, got {list(grid_features.shape)}"
            )
        ids = mask_to_grid(
            mask, (grid_features.shape[0], grid_features.shape[1]), num_classes
        ).ravel()  # [h*w]
        keep = ids >= 0
        xs.append(grid_features.flatten(0, 1)[keep])  # [n, F]
        ys.append(ids[keep])
    return torch.cat(xs), torch.cat(ys)


def fit_patch(
    train_features: Sequence[torch.Tensor | np.ndarray],
    train_masks: Sequence[np.ndarray],
    val_features: Sequence[torch.Tensor | np.ndarray],
    val_masks: Sequence[np.ndarray],
    num_classes: int,
    *,
    normalized: bool = False,
) -> PatchFit:
    """Softmax regression on patch rows; weight decay chosen by held-out patch accuracy, then scored per
    pixel on the held-out masks at full resolution (bilinear logits)."""
    prep = l2_normalize if normalized else (lambda t: t)
    x, y = _rows([prep(as_float_tensor(f)) for f in train_features], train_masks, num_classes)
    if len(y) == 0:
        raise InvalidOptionError("no patch of the training masks has a class (all ignored?)")
    if val_features:
        xv, yv = _rows([prep(as_float_tensor(f)) for f in val_features], val_masks, num_classes)
        fit = fit_softmax(x, y, xv, yv, num_classes)
    else:
        fit = fit_softmax(x, y, None, None, num_classes)
    score = None
    if val_features:
        predictions = [
            upsample_logits(fit.params.logits(prep(as_float_tensor(f))), (m.shape[0], m.shape[1]))
            for f, m in zip(val_features, val_masks, strict=True)
        ]
        score = segmentation_score(predictions, val_masks, num_classes)
    return PatchFit(fit.params, fit.weight_decay, score, fit.tried)


class PatchHead(SoftmaxHead):
    """Per-patch softmax: [B, h, w, F] → [B, h, w, C]."""

    KIND = "patch"

    def predict_proba(self, features: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(features), dim=-1)  # [B, h, w, C]

    def predict_grid(self, features: torch.Tensor) -> torch.Tensor:
        return self.logits(features).argmax(dim=-1)  # [B, h, w]
