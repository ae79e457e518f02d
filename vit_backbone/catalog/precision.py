"""Which compute precision a catalog job runs in: ``vit_backbone.precision.choose_autocast``, the same rule
the server uses, measured on a fixed set of images with the job's own embed options.

The choice is made once per catalog and stored (``catalog.json`` and every shard's ``precision``); a
resumed job reuses it instead of re-timing (timings on a busy machine vary, and one catalog must not mix
precisions).
"""

from __future__ import annotations

from typing import Any

from vit_backbone.backbone import Backbone
from vit_backbone.precision import PrecisionChoice, autocast_dtype, choose_autocast, probe_images

STORED = ("float32", "bfloat16", "float16")  # what a choice resolves to


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
