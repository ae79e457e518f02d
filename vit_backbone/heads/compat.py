"""Is this head usable on these features? Every difference is listed, none is tolerated.

A head trained on block 8 mean-pooled features of one checkpoint returns confident nonsense on block 11,
on another checkpoint, or on pixels preprocessed another way: nothing in the numbers says so. Hence the
card's facts are compared with the backbone (and, when the caller states them, the features it will feed)
and any difference is a ``HeadMismatchError`` naming each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidOptionError, VitEmbedError
from ..pooling import check_pooling
from .card import HeadCard

if TYPE_CHECKING:
    from ..backbone import Backbone


class HeadMismatchError(VitEmbedError):
    """The head was trained on other features than the ones offered; ``differences`` lists each fact."""

    code = "head_mismatch"

    def __init__(self, what: str, against: str, differences: Sequence[str]) -> None:
        self.differences = tuple(differences)
        super().__init__(f"{what} does not match {against}: {'; '.join(self.differences)}")


def feature_differences(
    card: HeadCard,
    *,
    revision: str | None = None,
    preprocess_hash: str | None = None,
    pooling: str | None = None,
    layers: Sequence[int] | None = None,
    dim: int | None = None,
    normalized: bool | None = None,
) -> list[str]:
    """``name: head X != features Y`` for every given fact that differs from the card."""
    wanted = {
        "revision": (card.revision, revision),
        "preprocess_hash": (card.preprocess_hash, preprocess_hash),
        "pooling": (card.pooling, pooling),
        "layers": (_layers(card.layers), _layers(layers)),
        "dim": (card.feature_dim, dim),
        "normalized": (card.normalized, normalized),
    }
    return [
        f"{name} {head} != {theirs}"
        for name, (head, theirs) in wanted.items()
        if theirs is not None and head != theirs
    ]


def _layers(layers: Sequence[int] | None) -> str | None:
    return None if layers is None else ",".join(str(i) for i in layers)


def backbone_differences(card: HeadCard, backbone: Backbone) -> list[str]:
    """What stops this head from running on ``backbone``: revision, preprocessing, blocks, width."""
    differences = feature_differences(
        card, revision=backbone.checkpoint.revision, preprocess_hash=backbone.preprocess_config.hash()
    )
    if card.interpolation is not None and card.interpolation != backbone.info_interpolation:
        differences.append(f"interpolation {card.interpolation} != {backbone.info_interpolation}")
    try:
        layers = backbone.resolve_layers(list(card.layers) if card.layers is not None else None)
    except InvalidOptionError:
        return [*differences, f"layers {_layers(card.layers)} do not exist in a {backbone.depth}-block model"]
    dim = backbone.output_dim(check_pooling(card.pooling), layers)
    if dim != card.feature_dim:
        differences.append(f"dim {card.feature_dim} != {dim}")
    return differences


def check_compatible(
    card: HeadCard,
    backbone: Backbone | None = None,
    *,
    what: str = "the head",
    pooling: str | None = None,
    layers: Sequence[int] | None = None,
    normalized: bool | None = None,
) -> None:
    """Raise ``HeadMismatchError`` if ``backbone`` (and the stated feature options) differ from the card."""
    differences = [] if backbone is None else backbone_differences(card, backbone)
    if backbone is not None and layers is not None:
        layers = backbone.resolve_layers(list(layers))
    differences += feature_differences(card, pooling=pooling, layers=layers, normalized=normalized)
    if differences:
        against = f"backbone {backbone.checkpoint.name!r}" if backbone is not None else "these features"
        raise HeadMismatchError(what, against, differences)
