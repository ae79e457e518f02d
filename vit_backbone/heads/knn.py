"""Weighted k-nearest-neighbour classifier, as in DINO's kNN evaluation.

Features are L2-normalised; similarity is the cosine (a dot product); each of the k most similar training
features votes for its class with weight ``exp(similarity / T)``, T = 0.07. The votes, divided by their
sum, are the class probabilities. k is chosen on the held-out split from a grid (DINO reports k = 10, 20,
100, 200; 20 is its default and ours without a held-out split). The head stores the normalised training
features themselves: there is nothing else to learn.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidOptionError
from .base import as_float_tensor, l2_normalize
from .card import HeadCard
from .linear import accuracy

TEMPERATURE = 0.07
DEFAULT_K = 20
K_GRID: tuple[int, ...] = (10, 20, 50, 100, 200)
_CHUNK = 1024  # query rows per similarity block: bounds memory at _CHUNK x N floats


def knn_proba(
    queries: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int,
    temperature: float = TEMPERATURE,
) -> torch.Tensor:
    """[B, F] normalised queries against [N, F] normalised bank → [B, C] vote shares."""
    k = min(k, len(bank))
    out = []
    for start in range(0, len(queries), _CHUNK):
        sims = queries[start : start + _CHUNK] @ bank.T  # [b, N]
        top, index = sims.topk(k, dim=1)  # [b, k]
        weights = (top / temperature).exp()  # [b, k]
        votes = torch.zeros(len(top), num_classes, dtype=weights.dtype, device=weights.device)  # [b, C]
        votes.scatter_add_(1, bank_labels[index], weights)
        out.append(votes / votes.sum(dim=1, keepdim=True))
    if not out:
        return torch.zeros(0, num_classes, device=bank.device)
    return torch.cat(out)  # [B, C]


@dataclass(frozen=True)
class KnnFit:
    bank: torch.Tensor  # [N, F], L2-normalised
    labels: torch.Tensor  # [N] int64
    k: int
    val_accuracy: float | None
    tried: dict[str, float]


def fit_knn(
    x_train: torch.Tensor | np.ndarray,
    y_train: Sequence[int] | np.ndarray | torch.Tensor,
    x_val: torch.Tensor | np.ndarray | None,
    y_val: Sequence[int] | np.ndarray | torch.Tensor | None,
    num_classes: int,
    *,
    ks: Sequence[int] = K_GRID,
    temperature: float = TEMPERATURE,
) -> KnnFit:
    """The bank is the training split; k is the grid value best on the held-out split (ties: smaller k)."""
    bank = l2_normalize(as_float_tensor(x_train))  # [N, F]
    labels = torch.as_tensor(np.asarray(y_train), dtype=torch.long)  # [N]
    if bank.dim() != 2 or len(bank) != len(labels) or len(labels) == 0:
        raise InvalidOptionError(
            f"expected features [N, F] and N labels, got {list(bank.shape)}, {len(labels)}"
        )
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        raise InvalidOptionError(f"labels must be in 0..{num_classes - 1}")
    if any(k < 1 for k in ks) or not ks:
        raise InvalidOptionError(f"k must be at least 1, got {list(ks)}")
    if x_val is None or y_val is None or len(y_val) == 0:
        return KnnFit(bank, labels, min(DEFAULT_K, len(bank)), None, {})
    queries = l2_normalize(as_float_tensor(x_val))  # [M, F]
    yv = torch.as_tensor(np.asarray(y_val), dtype=torch.long)
    candidates = sorted({min(k, len(bank)) for k in ks})
    tried = {
        str(k): accuracy(knn_proba(queries, bank, labels, num_classes, k, temperature).argmax(1), yv)
        for k in candidates
    }
    best = max(candidates, key=lambda k: tried[str(k)])  # first maximum = the smallest k
    return KnnFit(bank, labels, best, tried[str(best)], tried)


class KnnHead:
    def __init__(
        self, card: HeadCard, bank: torch.Tensor, labels: torch.Tensor, *, k: int, temperature: float
    ) -> None:
        if card.kind != "knn":
            raise InvalidOptionError(f"KnnHead needs a card of kind 'knn', got {card.kind!r}")
        if bank.dim() != 2 or bank.shape[1] != card.feature_dim or len(labels) != len(bank):
            raise InvalidOptionError(
                f"the kNN bank {list(bank.shape)} with {len(labels)} labels does not fit the card "
                f"(feature_dim {card.feature_dim})"
            )
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= card.num_classes):
            raise InvalidOptionError("the kNN bank has labels outside the card's classes")
        if k < 1 or temperature <= 0:
            raise InvalidOptionError(f"k must be ≥ 1 and the temperature > 0, got k={k}, T={temperature}")
        self.card = card
        self.bank = bank.float()
        self.labels = labels.long()
        self.k = k
        self.temperature = temperature

    def predict_proba(self, features: torch.Tensor) -> torch.Tensor:
        queries = l2_normalize(features.float())  # [B, F]
        return knn_proba(queries, self.bank, self.labels, self.card.num_classes, self.k, self.temperature)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"bank": self.bank, "labels": self.labels}

    def to(self, device: torch.device | str) -> KnnHead:
        """The bank on ``device``: the similarity of a batch to the bank runs where its features are."""
        moved = copy.copy(self)  # validated already; label values cannot be read back on every device
        moved.bank, moved.labels = self.bank.to(device), self.labels.to(device)
        return moved

    @classmethod
    def from_tensors(cls, card: HeadCard, tensors: dict[str, torch.Tensor]) -> KnnHead:
        if "bank" not in tensors or "labels" not in tensors:
            raise InvalidOptionError("the kNN head file lacks its 'bank' or 'labels' tensor")
        hyper = card.hyperparameters
        return cls(
            card,
            tensors["bank"],
            tensors["labels"],
            k=int(hyper.get("k", DEFAULT_K)),
            temperature=float(hyper.get("temperature", TEMPERATURE)),
        )
