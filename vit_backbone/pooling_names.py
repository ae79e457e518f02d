"""The pooling names and their families, without torch (command-line choices and ``--help`` read them);
what each one computes is in :mod:`vit_backbone.pooling`."""

from __future__ import annotations

from typing import Literal, get_args

Pooling = Literal[
    "cls",
    "pooler",
    "projection",
    "mean",
    "cls_mean",
    "gem",
    "patch",
    "linear_eval",
    "cls_hflip",
    "mean_hflip",
    "cls_mean_hflip",
    "gem_hflip",
]
POOLINGS: tuple[str, ...] = get_args(Pooling)
MIRRORED_SUFFIX = "_hflip"
NEEDS_CLS: tuple[str, ...] = ("cls", "cls_mean", "linear_eval", "cls_hflip", "cls_mean_hflip")
