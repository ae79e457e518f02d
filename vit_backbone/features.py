"""Typed bundles of the tokens a forward pass produces, named for what they hold."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LayerTokens:
    """The tokens of one block's output, each through the model's final norm."""

    cls: torch.Tensor | None  # [B, D]; None for families without a CLS token (SigLIP)
    registers: torch.Tensor  # [B, R, D]; R = 0 without registers
    patches: torch.Tensor  # [B, h, w, D]
    # [B, h, w] fraction of each patch that is image (pad's letterbox: 0); None = every patch is image
    valid: torch.Tensor | None = None

    @property
    def grid(self) -> tuple[int, int]:
        return int(self.patches.shape[1]), int(self.patches.shape[2])


@dataclass(frozen=True)
class Features:
    """Everything downstream heads need from one forward pass.

    ``cls``/``registers``/``patches`` are the last block's tokens through the final norm (DINOv2's
    ``x_norm_clstoken`` / ``x_norm_regtokens`` / ``x_norm_patchtokens``). ``layers`` holds the requested
    blocks, keyed by 0-based block index, through the same norm. ``pooler`` is the model's own
    ``pooler_output``: a Dense+tanh layer for ViT, attention pooling for SigLIP, the normed CLS otherwise.
    ``projection`` is a full CLIP/SigLIP checkpoint's image embedding in its joint image-text space.
    ``valid`` says which patches hold image (``pad``'s letterbox does not); patch-averaging poolings weight
    each patch by it.
    """

    cls: torch.Tensor | None  # [B, D]
    registers: torch.Tensor  # [B, R, D]
    patches: torch.Tensor  # [B, h, w, D]
    pooler: torch.Tensor | None  # [B, D]
    layers: dict[int, LayerTokens] = field(default_factory=dict)
    valid: torch.Tensor | None = None  # [B, h, w] image fraction per patch; None = all image
    # [B, E] the joint image-text embedding of a full CLIP/SigLIP checkpoint (get_image_features); else None
    projection: torch.Tensor | None = None

    @property
    def grid(self) -> tuple[int, int]:
        return int(self.patches.shape[1]), int(self.patches.shape[2])

    @property
    def last(self) -> LayerTokens:
        return LayerTokens(cls=self.cls, registers=self.registers, patches=self.patches, valid=self.valid)
