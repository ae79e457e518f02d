"""Mirror averaging: a feature of the image and of its mirror image (left-right), from one forward pass.

A copy that was mirrored (a common edit) should land on its original; averaging the two L2-normalised
features makes a mirrored copy's vector equal to the original's up to resampling, and it smooths the
feature for every other copy too (measured in ``bench/copy_detection.py``). Every resize policy is
left-right symmetric (centred crops, centred letterbox, borders trimmed on both sides), so mirroring the
preprocessed pixels equals preprocessing the mirrored image, up to the one-pixel rounding of an odd
centring margin: the batch is mirrored after preprocessing, and the validity mask with it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .pooling_names import MIRRORED_SUFFIX


def is_mirrored(pooling: str) -> bool:
    """A pooling averaged over the image and its mirror (needs the mirrored pass)."""
    return pooling.endswith(MIRRORED_SUFFIX)


def with_mirror(
    pixel_values: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch followed by its mirror image: [2b, 3, H, W] (and the mask [2b, h, w])."""
    pixels = torch.cat([pixel_values, pixel_values.flip(-1)], dim=0)  # [2b, 3, H, W]
    if valid is None:
        return pixels, None
    return pixels, torch.cat([valid, valid.flip(-1)], dim=0)  # [2b, h, w]


def fold_mirror(pooled: torch.Tensor) -> torch.Tensor:
    """[2b, F] features of (batch, mirrored batch) -> [b, F]: the mean of the two L2-normalised rows."""
    half = pooled.shape[0] // 2
    unit = torch.nn.functional.normalize(pooled.float(), dim=-1)  # [2b, F]
    return ((unit[:half] + unit[half:]) / 2).to(pooled.dtype)  # [b, F]


def forward_passes(poolings: Iterable[str]) -> int:
    """How many images' worth of forward pass one image costs when these poolings share its pass: 2 when any
    is mirror-averaged (the mirror image runs beside it), else 1. Batch limits and throughput estimates
    count an image's tokens times this."""
    return 2 if any(is_mirrored(p) for p in poolings) else 1


def original_half(pooled: torch.Tensor) -> torch.Tensor:
    """The un-mirrored images' rows of a mirrored batch's output ([2b, ...] -> [b, ...])."""
    return pooled[: pooled.shape[0] // 2]
