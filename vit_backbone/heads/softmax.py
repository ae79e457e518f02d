"""The standardise-then-linear classifier shared by the linear probe and the per-patch head.

Both kinds store the same four tensors (mean, scale, weight, bias); checking them against the card and
converting them to and from the saved tensors lives here, once, so neither kind reaches into the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Self

import torch

from ..errors import InvalidOptionError
from .base import l2_normalize
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


class SoftmaxHead:
    """What the linear and the per-patch head share: a card of their ``KIND`` and its fitting tensors,
    logits of the (optionally L2-normalised) features, and moving, saving and loading those tensors."""

    KIND: ClassVar[str]

    def __init__(self, card: HeadCard, params: SoftmaxParams) -> None:
        if card.kind != self.KIND:
            raise InvalidOptionError(
                f"{type(self).__name__} needs a card of kind {self.KIND!r}, got {card.kind!r}"
            )
        check_params(card, params)
        self.card = card
        self.params = params

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        x = features.float()  # [..., F]
        if self.card.normalized:
            x = l2_normalize(x)
        return self.params.logits(x)  # [..., C]

    def tensors(self) -> dict[str, torch.Tensor]:
        return params_tensors(self.params)

    def to(self, device: torch.device | str) -> Self:
        return type(self)(self.card, self.params.to(device))

    @classmethod
    def from_tensors(cls, card: HeadCard, tensors: dict[str, torch.Tensor]) -> Self:
        return cls(card, params_from_tensors(tensors))
