"""What every head offers, whatever its kind: its card, probabilities from features, its tensors."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .card import HeadCard


@runtime_checkable
class Head(Protocol):
    card: HeadCard

    def predict_proba(self, features: torch.Tensor) -> torch.Tensor:
        """[B, F] → [B, C] (patch heads: [B, h, w, F] → [B, h, w, C]); rows sum to 1."""
        ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights, as saved to ``HEAD.safetensors``."""
        ...

    def to(self, device: torch.device | str) -> Head:
        """The same head with every tensor on ``device``: heads are tiny, so they move to the backbone's
        device once (at bind time) instead of every batch's features moving to the CPU."""
        ...


def as_float_tensor(features: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A plain float32 CPU tensor that autograd may use (backbone outputs are inference-mode tensors)."""
    if isinstance(features, torch.Tensor):
        features = features.detach().to("cpu", torch.float32).numpy()
    return torch.from_numpy(np.array(features, dtype=np.float32, copy=True))


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)
