"""The standardise-then-linear classifier shared by the linear probe and the per-patch head.

Both kinds store the same four tensors (mean, scale, weight, bias); checking them against the card and
converting them to and from the saved tensors lives here, once, so neither kind reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidOptionError
from .card import HeadCard

PARAM_NAMES = ("mean", "scale", "weight", "bias")


@dataclass(frozen=True)
class SoftmaxParams:
    """A standardise-then-linear classifier: logits = ((x - mean) / scale) @ weight.T + bias."""

    mean: torch.Tensor  # [F]
    scale: torch.Tensor  # [F]
    weight: torch.Tensor  # [C, F]
    bias: torch.Tensor  # [C]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.float() - self.mean) / self.scale  # [..., F]
        return z @ self.weight.T + self.bias  # [..., C]

    def to(self, device: torch.device | str) -> SoftmaxParams:
        """The same classifier with every tensor on ``device`` (the backbone's, so features never move)."""
        return SoftmaxParams(
            self.mean.to(device), self.scale.to(device), self.weight.to(device), self.bias.to(device)
        )


def params_tensors(params: SoftmaxParams) -> dict[str, torch.Tensor]:
    return {"mean": params.mean, "scale": params.scale, "weight": params.weight, "bias": params.bias}


def params_from_tensors(tensors: dict[str, torch.Tensor]) -> SoftmaxParams:
    missing = sorted(set(PARAM_NAMES) - set(tensors))
    if missing:
        raise InvalidOptionError(f"the head file lacks tensor(s) {missing}")
    return SoftmaxParams(
        tensors["mean"].float(), tensors["scale"].float(), tensors["weight"].float(), tensors["bias"].float()
    )


def check_params(card: HeadCard, params: SoftmaxParams) -> None:
    """Refuse tensors whose shapes do not fit the card (a head file edited or paired with another card)."""
    shapes = {
        "mean": (tuple(params.mean.shape), (card.feature_dim,)),
        "scale": (tuple(params.scale.shape), (card.feature_dim,)),
        "weight": (tuple(params.weight.shape), (card.num_classes, card.feature_dim)),
        "bias": (tuple(params.bias.shape), (card.num_classes,)),
    }
    wrong = [f"{name} {got} (card says {want})" for name, (got, want) in shapes.items() if got != want]
    if wrong:
        raise InvalidOptionError(f"the head's tensors do not fit its card: {'; '.join(wrong)}")
