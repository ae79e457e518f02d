"""Linear probe: multinomial logistic regression on frozen features.

Features are standardised with the training split's mean and standard deviation (stored in the head), then
a softmax regression is fitted full-batch with L-BFGS (strong Wolfe line search) — deterministic and
tuning-free, unlike the SGD learning-rate sweep of DINOv2's linear evaluation. The weight decay (an L2
penalty on the weights, not the bias) is chosen from a grid by accuracy on the held-out split, fitting
from the strongest penalty down with warm starts. The saved head is the one fitted on the training split,
so the card's validation accuracy is the accuracy of exactly these weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidOptionError
from .base import as_float_tensor
from .softmax import SoftmaxHead, SoftmaxParams

WEIGHT_DECAYS: tuple[float, ...] = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 0.0)
DEFAULT_WEIGHT_DECAY = 1e-3
MAX_ITER = 300


@dataclass(frozen=True)
class SoftmaxFit:
    params: SoftmaxParams
    weight_decay: float
    val_accuracy: float | None
    tried: dict[str, float]  # weight decay -> held-out accuracy


def standardizer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(dim=0)  # [F]
    scale = x.std(dim=0, unbiased=False).clamp_min(1e-6)  # [F]
    return mean, scale


def _fit_one(
    z: torch.Tensor, y: torch.Tensor, num_classes: int, weight_decay: float, start: SoftmaxParams | None
) -> tuple[torch.Tensor, torch.Tensor]:
    dim = z.shape[1]
    weight = (start.weight.clone() if start else torch.zeros(num_classes, dim)).requires_grad_(True)  # [C, F]
    bias = (start.bias.clone() if start else torch.zeros(num_classes)).requires_grad_(True)  # [C]
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=MAX_ITER,
        history_size=20,
        tolerance_grad=1e-6,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ weight.T + bias, y)
        loss = loss + weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return weight.detach(), bias.detach()


def accuracy(predicted: torch.Tensor, y: torch.Tensor) -> float:
    return float((predicted == y).double().mean()) if len(y) else 0.0


def fit_softmax(
    x_train: torch.Tensor | np.ndarray,
    y_train: Sequence[int] | np.ndarray | torch.Tensor,
    x_val: torch.Tensor | np.ndarray | None,
    y_val: Sequence[int] | np.ndarray | torch.Tensor | None,
    num_classes: int,
    *,
    weight_decays: Sequence[float] = WEIGHT_DECAYS,
) -> SoftmaxFit:
    """Fit on the training rows for each weight decay; keep the best on the held-out rows (ties: the
    stronger penalty). Without held-out rows, ``DEFAULT_WEIGHT_DECAY`` is used and no accuracy reported."""
    x = as_float_tensor(x_train)  # [N, F]
    y = torch.as_tensor(np.asarray(y_train), dtype=torch.long)  # [N]
    if x.dim() != 2 or len(x) != len(y) or len(y) == 0:
        raise InvalidOptionError(f"expected features [N, F] and N labels, got {list(x.shape)} and {len(y)}")
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise InvalidOptionError(f"labels must be in 0..{num_classes - 1}")
    mean, scale = standardizer(x)
    z = (x - mean) / scale  # [N, F]
    if x_val is None or y_val is None or len(y_val) == 0:
        weight, bias = _fit_one(z, y, num_classes, DEFAULT_WEIGHT_DECAY, None)
        return SoftmaxFit(SoftmaxParams(mean, scale, weight, bias), DEFAULT_WEIGHT_DECAY, None, {})
    zv = (as_float_tensor(x_val) - mean) / scale  # [M, F]
    yv = torch.as_tensor(np.asarray(y_val), dtype=torch.long)  # [M]
    if not weight_decays:
        raise InvalidOptionError("give at least one weight decay to try")
    fits: list[SoftmaxFit] = []
    previous: SoftmaxParams | None = None
    tried: dict[str, float] = {}
    for decay in sorted(weight_decays, reverse=True):
        weight, bias = _fit_one(z, y, num_classes, decay, previous)
        previous = SoftmaxParams(mean, scale, weight, bias)
        acc = accuracy((zv @ weight.T + bias).argmax(dim=1), yv)
        tried[f"{decay:g}"] = acc
        fits.append(SoftmaxFit(previous, decay, acc, tried))
    best = max(fits, key=lambda fit: fit.val_accuracy or 0.0)  # first maximum = the strongest penalty
    return SoftmaxFit(best.params, best.weight_decay, best.val_accuracy, tried)


class LinearHead(SoftmaxHead):
    """Softmax over classes from one pooled feature per image."""

    KIND = "linear"

    def predict_proba(self, features: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(features), dim=-1)  # [B, F] -> [B, C]
