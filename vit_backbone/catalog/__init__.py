"""Offline catalogs: embed a folder or manifest of images into resumable Parquet shards (``embed-catalog``),
locally or on a Ray cluster. Pure library: no web framework, no environment variables.

Names are imported on first use, so ``vitembed --help`` (which registers the catalog subcommands) does
not pay for numpy, pyarrow or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Catalog": "shards",
    "read_catalog": "shards",
    "CatalogMeta": "meta",
    "CatalogError": "errors",
    "SourceError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'catalog' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
