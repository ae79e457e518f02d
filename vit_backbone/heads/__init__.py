"""Frozen heads: small classifiers trained on a frozen backbone's features, saved with a card.

``linear`` (softmax regression, the linear-probe protocol), ``knn`` (DINO's weighted kNN) and ``patch``
(a per-patch linear head for dense tasks). ``train_head`` goes from a folder or catalog Parquet to a head;
``save_head`` / ``load_head`` keep it as safetensors + a JSON card; loading against other features is a
``HeadMismatchError``.
"""

from __future__ import annotations

from .base import Head
from .card import HEAD_KINDS, HeadCard, HeadKind
from .compat import HeadMismatchError, check_compatible
from .features_cache import FeatureCache
from .io import load_head, read_card, save_head
from .knn import KnnHead
from .linear import LinearHead
from .patch import PatchHead
from .train import TrainOptions, TrainResult, train_head

__all__ = [
    "HEAD_KINDS",
    "FeatureCache",
    "Head",
    "HeadCard",
    "HeadKind",
    "HeadMismatchError",
    "KnnHead",
    "LinearHead",
    "PatchHead",
    "TrainOptions",
    "TrainResult",
    "check_compatible",
    "load_head",
    "read_card",
    "save_head",
    "train_head",
]
