"""What a request asks of the engine and what it gets back: options, outcomes, and the request-level
errors the engine raises (the HTTP layer maps them to statuses). No behaviour here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from vit_backbone.errors import VitEmbedError
from vitembed.engine.served_heads import BoundHead


class RequestImageError(Exception):
    """One image of a request is unusable; ``index`` is its 0-based position in the request."""

    def __init__(self, index: int, error: VitEmbedError) -> None:
        super().__init__(f"image {index}: {error}")
        self.index = index
        self.error = error


class NotReadyError(Exception):
    """The models are still loading, or a model worker has stopped (503)."""


@dataclass(frozen=True)
class EmbedOptions:
    pooling: str | None = None
    layers: tuple[int, ...] | None = None
    # None: the preset's box; "native": the model's own (how an index's stored null size is replayed)
    size: tuple[int, int] | Literal["native"] | None = None
    policy: str | None = None
    normalize: bool = False
    heads: tuple[str, ...] = ()  # heads computed from the same forward pass
    preset: str | None = None  # named defaults for the options not given (None: the model's)


@dataclass(frozen=True)
class EmbedOutcome:
    vectors: np.ndarray  # [n, F] or [n, h, w, F] float32, input order
    grids: list[tuple[int, int]]
    model: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: list[int] | None
    policy: str
    normalized: bool
    interpolation: str
    precision: str  # "float32" | "bfloat16" | "float16"
    heads: tuple[BoundHead, ...] = ()
    head_outputs: list[dict[str, np.ndarray]] = field(default_factory=list)  # per image: see head_outputs
    valid: list[np.ndarray] = field(default_factory=list)  # per image [h, w]: image fraction of each patch
    preset: str = ""  # the named defaults that filled in the options not given
    size: tuple[int, int] | None = None  # the box [h, w] the images were prepared for; None: native size
    precision_cosine: float | None = None  # min cosine to float32 measured at start-up (None: not measured)


@dataclass(frozen=True)
class ClassifyOutcome:
    head: BoundHead
    outputs: list[np.ndarray]  # per image: probabilities [C], or logits [h, w, C] for a patch head
    source_sizes: list[tuple[int, int]]  # (H, W) of each input image
    precision: str  # "float32" | "bfloat16" | "float16"
    precision_cosine: float | None = None  # min cosine to float32 measured at start-up
    # per image (top, left, height, width) of the image inside pad's letterbox (None: the whole tensor)
    image_boxes: list[tuple[int, int, int, int] | None] = field(default_factory=list)
    patch: tuple[int, int] = (1, 1)  # the model's patch size (H, W)
