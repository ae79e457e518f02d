"""Which compute precision a catalog job runs in: bfloat16 autocast only where the hardware runs it
natively, it is faster, and its vectors keep cosine ≥ 0.999 to float32 on a fixed set of images.

The same rule as the service's, so a catalog and a server on the same machine agree. The choice is made
once per catalog and stored in ``catalog.json``; a resumed job reuses it instead of re-timing (timings on
a busy machine vary, and one catalog must not mix precisions).
"""

from __future__ import annotations

import time

import numpy as np
from PIL import Image

from vit_backbone.backbone import Backbone
from vit_backbone.precision import MIN_COSINE, autocast_dtype, min_cosine

PRECISIONS = ("auto", "float32", "bfloat16")


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


def _timed(backbone: Backbone, images: list[Image.Image], **options: object) -> tuple[np.ndarray, float]:
    backbone.embed(images[:1], **options)  # type: ignore[arg-type]  # first-call costs
    started = time.perf_counter()
    vectors = backbone.embed(images * 2, batch_size=8, **options)  # type: ignore[arg-type]
    return vectors, time.perf_counter() - started


def choose_precision(backbone: Backbone, requested: str, **options: object) -> str:
    """Set ``backbone.autocast`` for ``requested`` and return what was chosen: "float32" or "bfloat16".

    ``options`` are the job's embed options (pooling, layers, size, policy), so the check measures the
    vectors the catalog will store. An explicit "bfloat16" is still refused when it changes the vectors
    too much (min cosine < 0.999), with the measured cosine in the message.
    """
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    backbone.autocast = None
    dtype = autocast_dtype(requested, backbone.device)
    if dtype is None:
        return "float32"
    images = probe_images()
    reference, fp32_s = _timed(backbone, images, **options)
    backbone.autocast = dtype
    candidate, low_s = _timed(backbone, images, **options)
    cosine = min_cosine(reference, candidate)
    if cosine < MIN_COSINE:
        backbone.autocast = None
        if requested == "bfloat16":
            raise ValueError(
                f"bfloat16 changes this model's vectors too much (min cosine {cosine:.5f} < {MIN_COSINE}); "
                "use --precision float32"
            )
        return "float32"
    if requested == "auto" and low_s >= fp32_s:
        backbone.autocast = None
        return "float32"
    return "bfloat16"


def apply_precision(backbone: Backbone, chosen: str) -> None:
    """Re-apply a choice stored by an earlier run of the same catalog."""
    if chosen not in ("float32", "bfloat16"):
        raise ValueError(f"stored precision must be float32 or bfloat16, got {chosen!r}")
    backbone.autocast = None if chosen == "float32" else autocast_dtype("bfloat16", backbone.device)
