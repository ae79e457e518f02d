"""The projected image embedding of a full CLIP or SigLIP checkpoint: the image side of the joint image-text
space, what transformers' ``get_image_features`` returns (and what CLIP/SigLIP users compare with text).

- CLIP: ``visual_projection`` (a bias-free linear map) applied to the pooler output (the post-layernorm CLS).
  The vision tower does not hold it, so its weight is read from the checkpoint's safetensors.
- SigLIP: the attention-pooling head's output itself (SigLIP has no separate projection). With ``pad``, the
  head's probe attends to the image patches only: letterbox keys (patches with no image pixel) are masked,
  so the letterbox does not enter the pooled vector through the head (the encoder's own attention still sees
  it: SigLIP's vision model takes no attention mask). Under ``crop`` and ``squash`` (no letterbox) this is
  exactly ``get_image_features``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from .model_config import ModelConfig

ProjectionKind = Literal["linear", "head"]
_CLIP_KEY = "visual_projection.weight"


class ImageProjection:
    """Pooler output (+ the final-norm patch tokens for SigLIP's head) → the joint-space image embedding."""

    def __init__(self, kind: ProjectionKind, module: torch.nn.Module) -> None:
        self.kind = kind
        self.module = module

    @property
    def dim(self) -> int | None:
        if isinstance(self.module, torch.nn.Linear):
            return int(self.module.out_features)
        return None  # the head keeps the width

    def __call__(
        self, pooler: torch.Tensor | None, patches: torch.Tensor, valid: torch.Tensor | None
    ) -> torch.Tensor:
        """``pooler`` [B, D], ``patches`` [B, h, w, D] (final norm), ``valid`` [B, h, w] or None → [B, E]."""
        if self.kind == "linear":
            if pooler is None:
                raise ValueError("CLIP's projection needs the pooler output")
            weight: torch.Tensor = self.module.weight  # type: ignore[assignment]  # [E, D]
            out: torch.Tensor = self.module(pooler.to(weight.dtype))  # [B, E]
            return out
        if valid is None and pooler is not None:
            return pooler  # the head's own output: get_image_features
        return masked_head(
            self.module, patches.flatten(1, 2), None if valid is None else valid.flatten(1) > 0
        )


def masked_head(head: Any, tokens: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """SigLIP's ``SiglipMultiheadAttentionPoolingHead`` on ``tokens`` [B, N, D] with the keys where ``keep``
    [B, N] is False left out of the probe's attention. [B, D]"""
    probe = head.probe.repeat(tokens.shape[0], 1, 1)  # [B, 1, D]
    padding = None if keep is None else ~keep.to(tokens.device)  # [B, N]; True = ignored
    hidden: torch.Tensor = head.attention(probe, tokens, tokens, key_padding_mask=padding)[0]  # [B, 1, D]
    hidden = hidden + head.mlp(head.layernorm(hidden))  # [B, 1, D]
    return hidden[:, 0]  # [B, D]


def load_projection(folder: Path, config: ModelConfig, model: torch.nn.Module) -> ImageProjection | None:
    """The projection of a full (dual-encoder) CLIP/SigLIP checkpoint; None for every other checkpoint."""
    spec = config.spec
    if str(config.raw.get("model_type")) not in spec.dual_encoder_types:
        return None
    if spec.name == "siglip":
        head = getattr(getattr(model, "vision_model", model), "head", None)
        return None if head is None else ImageProjection("head", head)
    if spec.name == "clip":
        weight = _read_tensor(folder, _CLIP_KEY)
        if weight is None:
            return None
        dtype = next(model.parameters()).dtype
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)  # D -> E
        with torch.no_grad():
            linear.weight.copy_(weight)
        linear.to(next(model.parameters()).device).eval()
        return ImageProjection("linear", linear)
    return None


def _read_tensor(folder: Path, key: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor: torch.Tensor = handle.get_tensor(key)
                return tensor
    return None
