"""Finding a transformers model's parts by path (``embeddings.patch_embeddings``) or by shape (the ModuleList
of its blocks), so that one Backbone serves every family without a table of attribute names per family."""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnsupportedModelError


def find_blocks(model: torch.nn.Module, depth: int) -> tuple[torch.nn.Module, str]:
    """The ModuleList of the transformer blocks (``encoder.layer``, ``encoder.layers``, ``model.layer``...
    depending on the family), found by shape rather than by a name per family."""
    found = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == depth
    ]
    if not found:
        raise UnsupportedModelError(f"cannot find the {depth} transformer blocks in {type(model).__name__}")
    path = min(found, key=len)
    owner_path, _, name = path.rpartition(".")
    return (get_attr(model, owner_path) if owner_path else model), name


def get_attr(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root
