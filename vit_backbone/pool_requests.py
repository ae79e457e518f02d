"""Several poolings from one forward pass.

A server that returns an embedding *and* the outputs of heads trained on other poolings or blocks must not
run the network once per output: every request here is served from one pass that computes the union of
the requested blocks (stopping at the deepest one unless a request needs the model's own pooler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .errors import InvalidOptionError
from .features import Features, LayerTokens
from .mirror import fold_mirror, original_half, with_mirror
from .pooling import WHOLE_NETWORK, Pooling, check_pooling, is_mirrored, pool, pool_layers, unmirrored


class TokenSource(Protocol):
    """What pooling several requests needs of a backbone (``Backbone`` is one): no import of it, no cycle."""

    depth: int

    def resolve_layers(self, layers: int | Sequence[int] | None) -> list[int] | None: ...

    def features(
        self,
        pixel_values: torch.Tensor,
        *,
        layers: int | Sequence[int] | None = ...,
        valid: torch.Tensor | None = ...,
    ) -> Features: ...

    def layer_features(
        self,
        pixel_values: torch.Tensor,
        layers: int | Sequence[int] | None,
        *,
        valid: torch.Tensor | None = ...,
    ) -> dict[int, LayerTokens]: ...


PoolRequest = tuple[Pooling, Sequence[int] | None]  # (pooling, 0-based blocks; None = last block)


def pooled_many(
    backbone: TokenSource,
    pixel_values: torch.Tensor,
    requests: Sequence[PoolRequest],
    *,
    valid: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """One pooled tensor per request ([b, F] or [b, h, w, F]), all from a single forward pass.

    Equal to ``backbone.pooled(pixel_values, pooling, layers)`` for each request. ``layers=None`` means the
    last block, which is the same tokens as ``[depth - 1]`` through the final norm, so it joins the union.
    A mirror-averaged pooling (``*_hflip``) runs the pass on the batch and its mirror image together; the
    other requests then read the un-mirrored half.
    """
    if not requests:
        raise InvalidOptionError("pooled_many needs at least one (pooling, layers) request")
    resolved: list[tuple[Pooling, list[int] | None]] = []
    for pooling, layers in requests:
        chosen = check_pooling(pooling)
        resolved.append((chosen, backbone.resolve_layers(list(layers) if layers is not None else None)))
    union = sorted({i for _, layers in resolved for i in (layers or [backbone.depth - 1])})
    mirrored = any(is_mirrored(pooling) for pooling, _ in resolved)
    if mirrored:
        pixel_values, valid = with_mirror(pixel_values, valid)  # [2b, 3, H, W], [2b, h, w]
    if any(pooling in WHOLE_NETWORK for pooling, _ in resolved):  # the model's own head: the whole network
        features = backbone.features(pixel_values, layers=union, valid=valid)
        pooled = [pool(features, unmirrored(pooling), layers) for pooling, layers in resolved]
    else:
        tokens = backbone.layer_features(pixel_values, union, valid=valid)  # stops at the deepest block
        pooled = [
            pool_layers(tokens, unmirrored(pooling), layers if layers is not None else [backbone.depth - 1])
            for pooling, layers in resolved
        ]
    if not mirrored:
        return pooled
    return [
        fold_mirror(x) if is_mirrored(pooling) else original_half(x)  # [b, F] / [b, h, w, F]
        for x, (pooling, _) in zip(pooled, resolved, strict=True)
    ]
