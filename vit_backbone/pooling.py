"""Poolings: how token sets become one feature per image. Each is a distinct feature, never mixed silently.

- ``cls``: the CLS token after the final norm.
- ``pooler``: the model's own pooler_output (ViT's Dense+tanh, SigLIP's attention pooling); last block only.
- ``projection``: a full CLIP/SigLIP checkpoint's image embedding in the joint image-text space (transformers'
  ``get_image_features``; :mod:`vit_backbone.projection`); last block only.
- ``mean``: mean of the patch tokens; CLS and registers excluded. With ``pad``, only the image: each patch
  counts by the fraction of its pixels that are image (``LayerTokens.valid``), so the letterbox never enters
  (``mean``, ``cls_mean``, ``gem`` and ``linear_eval``'s mean part alike).
- ``cls_mean``: ``cls`` and ``mean`` concatenated.
- ``gem``: generalised mean of the patch tokens with p = 3, sign-preserving (ViT tokens are signed;
  the usual clamp-at-zero GeM would discard half of each channel). Equals classic GeM for non-negative input.
- ``patch``: the patch grid [B, h, w, D].
- ``linear_eval``: the DINOv2 linear-evaluation input: CLS of each requested block, then the mean patch
  token of the last requested block (``create_linear_input`` with ``use_avgpool=True``).
- ``cls_hflip``, ``mean_hflip``, ``cls_mean_hflip``, ``gem_hflip``: the same pooling averaged over the image
  and its mirror image (left-right): the mean of the two L2-normalised features, from one forward pass on
  both (:mod:`vit_backbone.mirror`). A mirrored copy then lands on its original's vector; it costs a forward
  pass of twice the batch.

With several blocks, each block's pooled feature is concatenated in the order given ([B, L*D], or
[B, h, w, L*D] for ``patch``), except ``linear_eval`` whose layout is the recipe's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .errors import InvalidOptionError
from .features import Features, LayerTokens
from .mirror import is_mirrored
from .pooling_names import MIRRORED_SUFFIX, POOLINGS, Pooling

WHOLE_NETWORK: tuple[str, ...] = ("pooler", "projection")  # the model's own heads: last block, full forward
GEM_P = 3.0


def check_pooling(pooling: str) -> Pooling:
    if pooling not in POOLINGS:
        raise InvalidOptionError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    return pooling  # type: ignore[return-value]


def unmirrored(pooling: Pooling) -> Pooling:
    """The pooling a mirrored one averages (``cls_mean_hflip`` -> ``cls_mean``); others unchanged."""
    return pooling.removesuffix(MIRRORED_SUFFIX) if is_mirrored(pooling) else pooling  # type: ignore[return-value]


def _refuse_mirrored(pooling: str) -> None:
    if is_mirrored(pooling):
        raise InvalidOptionError(
            f"pooling={pooling!r} averages the image and its mirror image, so it needs both forward passes: "
            "use Backbone.pooled / pooled_many / embed, not pooling of tokens already computed"
        )


def _require_cls(tokens: LayerTokens, pooling: str) -> torch.Tensor:
    if tokens.cls is None:
        raise InvalidOptionError(
            f"pooling={pooling!r} needs a CLS token, and this model has none (SigLIP); "
            f"use pooling='pooler' (its attention pooling) or 'mean'"
        )
    return tokens.cls


def _weighted_mean(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean over N of ``x`` [B, N, D], each token weighted by ``valid`` [B, h, w] (None: plain mean)."""
    if valid is None:
        return x.mean(dim=1)  # [B, D]
    w = valid.flatten(1).to(device=x.device, dtype=torch.float32)  # [B, N]
    w = w / w.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.einsum("bnd,bn->bd", x.float(), w).to(x.dtype)  # [B, D]


def mean_patches(tokens: LayerTokens) -> torch.Tensor:  # [B, D]
    return _weighted_mean(tokens.patches.flatten(1, 2), tokens.valid)


def gem_patches(tokens: LayerTokens, p: float = GEM_P) -> torch.Tensor:  # [B, D]
    x = tokens.patches.flatten(1, 2).float()  # [B, N, D]
    m = _weighted_mean(x.sign() * x.abs().pow(p), tokens.valid)  # [B, D]
    return (m.sign() * m.abs().pow(1.0 / p)).to(tokens.patches.dtype)


def pool_layer(tokens: LayerTokens, pooling: Pooling) -> torch.Tensor:
    if pooling == "cls":
        return _require_cls(tokens, pooling)
    if pooling == "mean":
        return mean_patches(tokens)
    if pooling == "cls_mean":
        return torch.cat([_require_cls(tokens, pooling), mean_patches(tokens)], dim=-1)  # [B, 2D]
    if pooling == "gem":
        return gem_patches(tokens)
    if pooling == "patch":
        return tokens.patches
    _refuse_mirrored(pooling)
    raise InvalidOptionError(f"pooling {pooling!r} is not a per-block pooling")


def pool(features: Features, pooling: Pooling, layers: Sequence[int] | None) -> torch.Tensor:
    """Pool ``features`` whose ``layers`` already hold every requested block (None = last block)."""
    _refuse_mirrored(pooling)
    if pooling == "projection":
        if layers is not None:
            raise InvalidOptionError(
                "pooling='projection' is the joint image-text embedding of the last block; drop `layers`"
            )
        if features.projection is None:
            raise InvalidOptionError(
                "pooling='projection' needs a full CLIP or SigLIP checkpoint (with its image projection); "
                "this one has none: use pooling='cls', 'mean' or 'pooler'"
            )
        return features.projection
    if pooling == "pooler":
        if layers is not None:
            raise InvalidOptionError(
                "pooling='pooler' is the model's own head on the last block; drop `layers`"
            )
        if features.pooler is None:
            raise InvalidOptionError("this checkpoint has no pooler weights; use pooling='cls'")
        return features.pooler
    if layers is not None:
        return pool_layers(features.layers, pooling, layers)
    return _pool_blocks([features.last], pooling)


def pool_layers(tokens: Mapping[int, LayerTokens], pooling: Pooling, layers: Sequence[int]) -> torch.Tensor:
    """Pool the requested blocks, in the order given."""
    _refuse_mirrored(pooling)
    if pooling in WHOLE_NETWORK:
        raise InvalidOptionError(
            f"pooling={pooling!r} is the model's own head on the last block; drop `layers`"
        )
    return _pool_blocks([tokens[i] for i in layers], pooling)


def _pool_blocks(chosen: Sequence[LayerTokens], pooling: Pooling) -> torch.Tensor:
    if pooling == "linear_eval":
        cls_tokens = [_require_cls(t, pooling) for t in chosen]
        return torch.cat([*cls_tokens, mean_patches(chosen[-1])], dim=-1)  # [B, (L+1)*D]
    parts = [pool_layer(t, pooling) for t in chosen]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def pooled_dim(pooling: Pooling, dim: int, num_layers: int) -> int:
    """Width of the pooled feature (per patch for ``patch``)."""
    pooling = unmirrored(pooling)
    per_layer = {"cls_mean": 2 * dim}.get(pooling, dim)
    if pooling == "pooler":
        return dim
    if pooling == "linear_eval":
        return (num_layers + 1) * dim
    return per_layer * num_layers


def pooled_array(pooled: torch.Tensor, normalize: bool) -> np.ndarray:
    """Pooled features as the float32 numpy rows every caller returns: L2-normalised over the last axis
    (per patch for ``patch``) when asked."""
    pooled = pooled.float()  # [b, F] or [b, h, w, F]
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
    return pooled.cpu().numpy()


def nonfinite_rows(rows: np.ndarray) -> np.ndarray:
    """Indices of the rows (first axis) holding NaN or infinity anywhere: [k] int, empty when all finite."""
    return np.flatnonzero(~np.isfinite(rows).reshape(len(rows), -1).all(axis=1))
