"""Running a trained head on images: the head's own features (its card's pooling, blocks, size and
policy), then its probabilities. The HTTP service computes the same from a shared forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import InvalidOptionError
from ..preprocess_config import literal_size
from .base import Head
from .card import HeadCard
from .compat import check_compatible
from .patch import PatchHead, UpsampleMode, patch_ids

if TYPE_CHECKING:
    from ..backbone import Backbone, ImageInput
    from ..pooling import Pooling
    from ..preprocess import Prepared, ResizePolicy


@dataclass(frozen=True)
class HeadInputs:
    """The features a head reads, resolved on one backbone."""

    pooling: Pooling
    layers: list[int] | None
    size: tuple[int, int] | None
    policy: ResizePolicy


def head_inputs(card: HeadCard, backbone: Backbone) -> HeadInputs:
    from ..pooling import check_pooling

    return HeadInputs(
        pooling=check_pooling(card.pooling),
        layers=backbone.resolve_layers(list(card.layers) if card.layers is not None else None),
        size=card.size,
        policy=backbone.check_policy(card.policy, card.preset or "default-v1"),
    )


def _prepare(
    backbone: Backbone, head: Head, images: Sequence[ImageInput]
) -> tuple[HeadInputs, list[Prepared]]:
    check_compatible(head.card, backbone)
    inputs = head_inputs(head.card, backbone)
    return inputs, backbone.prepare(list(images), size=literal_size(inputs.size), policy=inputs.policy)


def predict_proba(
    backbone: Backbone, head: Head, images: Sequence[ImageInput], *, batch_size: int = 8
) -> np.ndarray:
    """[n, C] class probabilities, input order (classifier heads)."""
    if head.card.kind == "patch":
        raise InvalidOptionError("a patch head gives a class grid per image: use predict_masks")
    inputs, prepared = _prepare(backbone, head, images)
    features = backbone.embed_prepared(
        prepared, pooling=inputs.pooling, layers=inputs.layers, batch_size=batch_size
    )
    return head.predict_proba(torch.from_numpy(features)).numpy()  # [n, C]


def predict_masks(
    backbone: Backbone,
    head: Head,
    images: Sequence[ImageInput],
    *,
    upsample: bool = False,
    mode: UpsampleMode = "bilinear",
) -> list[np.ndarray]:
    """Per image the class ids on the patch grid [h, w] (IGNORE on ``pad``'s letterbox), or at the input
    image's size [H, W]."""
    if not isinstance(head, PatchHead):
        raise InvalidOptionError(f"a {head.card.kind} head gives labels, not masks: use predict_proba")
    inputs, prepared = _prepare(backbone, head, images)
    out = []
    for item in prepared:  # grids may differ (policy dynamic): one image at a time
        grid = backbone.embed_prepared([item], pooling="patch", layers=inputs.layers)  # [1, h, w, F]
        logits = head.logits(torch.from_numpy(grid))[0]  # [h, w, C]
        ids = patch_ids(
            logits,
            patch=backbone.patch_size,
            box=item.image_box,
            upsample_to=item.source_size if upsample else None,
            mode=mode,
        )
        out.append(ids.numpy().astype(np.int64))
    return out
