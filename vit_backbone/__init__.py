"""vit_backbone: the right features from any ViT-family checkpoint, as a pure library.

No web framework, no asyncio, no environment variables: the HTTP service and the CLI live in ``vitembed``.
Public names resolve lazily so that ``import vit_backbone.errors`` (or the CLI's ``--help``) does not pay
for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backbone import Backbone
    from .backbone_facts import BackboneInfo, EmbedDefaults, EmbedResult
    from .errors import (
        ImageDecodeError,
        InvalidOptionError,
        MissingExtraError,
        ModelLoadError,
        ModelNotFoundError,
        SizeError,
        UnsafeCheckpointError,
        UnsupportedModelError,
        VitEmbedError,
    )
    from .features import Features, LayerTokens
    from .loading import load_backbone
    from .pooling import POOLINGS, Pooling

_EXPORTS = {
    "Backbone": "backbone",
    "BackboneInfo": "backbone_facts",
    "EmbedDefaults": "backbone_facts",
    "EmbedResult": "backbone_facts",
    "load_backbone": "loading",
    "Features": "features",
    "LayerTokens": "features",
    "POOLINGS": "pooling",
    "Pooling": "pooling",
    "ImageDecodeError": "errors",
    "InvalidOptionError": "errors",
    "MissingExtraError": "errors",
    "ModelLoadError": "errors",
    "ModelNotFoundError": "errors",
    "SizeError": "errors",
    "UnsafeCheckpointError": "errors",
    "UnsupportedModelError": "errors",
    "VitEmbedError": "errors",
}

__all__ = [
    "POOLINGS",
    "Backbone",
    "BackboneInfo",
    "EmbedDefaults",
    "EmbedResult",
    "Features",
    "ImageDecodeError",
    "InvalidOptionError",
    "LayerTokens",
    "MissingExtraError",
    "ModelLoadError",
    "ModelNotFoundError",
    "Pooling",
    "SizeError",
    "UnsafeCheckpointError",
    "UnsupportedModelError",
    "VitEmbedError",
    "load_backbone",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vit_backbone' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
