"""What a :class:`~vit_backbone.backbone.Backbone` states: its embed defaults, the facts that decide what
its numbers mean (``info()``), and an embedding with its provenance (``embed_result()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .pooling_names import NEEDS_CLS, POOLINGS, Pooling
from .preprocess import ResizePolicy

if TYPE_CHECKING:
    from .backbone import Backbone


@dataclass(frozen=True)
class EmbedDefaults:
    """What ``embed(images)`` does with no options; the embedded model's values are measured choices."""

    pooling: Pooling = "cls"
    layers: tuple[int, ...] | None = None
    policy: ResizePolicy = "crop"
    preset: str = ""  # the named preset these come from (vit_backbone.presets); "" = set by hand
    size: tuple[int, int] | None = None  # the box [h, w] when no size is asked for; None: the native size


@dataclass(frozen=True)
class EmbedResult:
    """Vectors plus everything needed to know what they mean and to reproduce them."""

    vectors: np.ndarray  # [B, F] float32, or [B, h, w, F] for pooling="patch"
    grids: list[tuple[int, int]]  # effective patch grid per input image
    valid: list[np.ndarray]  # [h, w] float32 per image: image fraction of each patch (pad's letterbox: 0)
    model: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: list[int] | None  # 0-based block indices; None = last block
    policy: str
    size: tuple[int, int] | None
    normalized: bool
    interpolation: str
    preset: str = ""  # the preset that filled in the options not given (vit_backbone.presets)


@dataclass(frozen=True)
class BackboneInfo:
    name: str
    revision: str
    source: str
    family: str
    model_class: str
    dim: int
    depth: int
    heads: int
    patch_size: tuple[int, int]
    native_grid: tuple[int, int]
    native_size: tuple[int, int]
    processing_grid: tuple[
        int, int
    ]  # the grid of the checkpoint's own preprocessing (dynamic's default budget)
    prefix_tokens: int
    has_cls: bool
    registers: int
    pos_embed: str
    interpolation: str  # the user-facing rule
    resample: str  # what it resolves to for this family
    final_norm: str
    pooler: str
    params: int
    dtype: str
    device: str
    preprocess: dict[str, Any]
    preprocess_hash: str
    defaults: dict[str, Any] = field(default_factory=dict)
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)  # every preset's defaults, by name
    poolings: list[str] = field(default_factory=list)  # the poolings this checkpoint offers
    projection_dim: int | None = None  # width of pooling="projection" (full CLIP/SigLIP); None without it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def backbone_info(backbone: Backbone) -> BackboneInfo:
    """Every fact that decides what the backbone's numbers mean."""
    native = (
        backbone.native_grid[0] * backbone.patch_size[0],
        backbone.native_grid[1] * backbone.patch_size[1],
    )
    return BackboneInfo(
        name=backbone.checkpoint.name,
        revision=backbone.checkpoint.revision,
        source=backbone.checkpoint.source,
        family=backbone.spec.name,
        model_class=backbone.spec.model_class,
        dim=backbone.dim,
        depth=backbone.depth,
        heads=backbone.heads,
        patch_size=backbone.patch_size,
        native_grid=backbone.native_grid,
        native_size=native,
        processing_grid=backbone.processing_grid,
        prefix_tokens=backbone.prefix_tokens,
        has_cls=backbone.spec.has_cls,
        registers=backbone.num_registers,
        pos_embed=backbone.spec.pos_embed,
        interpolation=backbone.info_interpolation,
        resample=backbone.resample if backbone.spec.pos_embed == "learned" else "none",
        final_norm=backbone.spec.final_norm,
        pooler=backbone.spec.pooler,
        params=sum(p.numel() for p in backbone.model.parameters()),
        dtype=str(backbone.dtype).removeprefix("torch."),
        device=str(backbone.device),
        preprocess=backbone.preprocess_config.to_dict(),
        preprocess_hash=backbone.preprocess_config.hash(),
        defaults=_defaults_dict(backbone.defaults),
        presets={name: _defaults_dict(d) for name, d in backbone.presets.items()},
        poolings=[
            p
            for p in POOLINGS
            if (backbone.spec.has_cls or p not in NEEDS_CLS)
            and (p != "projection" or backbone.projection is not None)
        ],
        projection_dim=None if backbone.projection is None else backbone.output_dim("projection", None),
    )


def _defaults_dict(d: EmbedDefaults) -> dict[str, Any]:
    return {
        "pooling": d.pooling,
        "layers": None if d.layers is None else list(d.layers),
        "policy": d.policy,
        "size": None if d.size is None else list(d.size),
        "preset": d.preset,
    }
