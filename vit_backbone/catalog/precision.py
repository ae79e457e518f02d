"""Which compute precision a catalog job runs in: ``vit_backbone.precision.choose_autocast``, the same rule
the server uses, measured on a fixed set of images with the job's own embed options.

The choice is made once per catalog and stored (``catalog.json`` and every shard's ``precision``); a
resumed job reuses it instead of re-timing (timings on a busy machine vary, and one catalog must not mix
precisions).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from vit_backbone.backbone import Backbone
from vit_backbone.precision import PrecisionChoice, autocast_dtype, choose_autocast

PRECISIONS = ("auto", "float32", "bfloat16", "float16")
STORED = ("float32", "bfloat16", "float16")  # what a choice resolves to


def probe_images() -> list[Image.Image]:
    """Deterministic textured images of several aspect ratios (no data files needed)."""
    rng = np.random.default_rng(0)
    images = []
    for height, width in ((480, 640), (600, 400), (512, 512), (300, 900)):
        yy, xx = np.mgrid[0:height, 0:width]
        base = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 127 // (height + width)], -1)
        noise = rng.integers(0, 64, size=(height, width, 3))
        images.append(Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)))
    return images


def choose_precision(
    backbone: Backbone, requested: str, *, batch_size: int = 8, **options: Any
) -> PrecisionChoice:
    """Resolve ``requested`` with the shared rule and set ``backbone.autocast`` to the result.

    ``options`` are the job's embed options (pooling, layers, size, policy), so the check measures the
    vectors the catalog will store; the probe runs at the job's batch size.
    """
    choice = choose_autocast(backbone, requested, probe_images(), batch_size=batch_size, **options)
    backbone.autocast = choice.dtype
    return choice


def apply_precision(backbone: Backbone, chosen: str) -> None:
    """Re-apply a choice stored by an earlier run of the same catalog (or given explicitly to a Ray actor)."""
    if chosen not in STORED:
        raise ValueError(f"stored precision must be one of {', '.join(STORED)}, got {chosen!r}")
    backbone.autocast = autocast_dtype(chosen, backbone.device)
