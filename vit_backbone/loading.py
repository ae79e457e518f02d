"""Loading a backbone: resolve the checkpoint, read its config, build the transformers vision tower from its
weights, and wrap it in a :class:`~vit_backbone.backbone.Backbone`.

Weights load from safetensors only unless pickle is explicitly allowed, and never through remote code:
the transformers class comes from our family spec, not from the checkpoint's ``auto_map``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .backbone import Backbone
from .checkpoint import (
    check_weights_safe,
    has_tensor_prefix,
    load_config,
    preprocess_config,
    read_embed_defaults,
    resolve_checkpoint,
)
from .errors import ModelNotFoundError
from .model_config import ModelConfig
from .native_dinov2 import load_native
from .presets import resolve_presets
from .projection import load_projection
from .specs import InterpolationRule


def load_backbone(
    name_or_path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    interpolation: InterpolationRule = "transformers",
    allow_pickle: bool = False,
    cache_dir: Path | None = None,
    autocast: torch.dtype | None = None,
    preset: str | None = None,
) -> Backbone:
    """Load a ViT-family backbone from a local HF folder, a hub id (local cache first) or `embedded`.
    ``preset`` names its defaults (vit_backbone.presets; None: the current default preset)."""
    checkpoint = resolve_checkpoint(name_or_path, cache_dir=cache_dir)
    config = load_config(checkpoint.path)
    config.spec.resample_method(interpolation)  # validate before paying for the weights
    model = instantiate_model(checkpoint.path, config, allow_pickle=allow_pickle, dtype=dtype)
    model.to(torch.device(device))
    projection = load_projection(checkpoint.path, config, model)
    presets = resolve_presets(
        embedded=checkpoint.source == "embedded",
        family_pooling=config.spec.default_pooling,
        has_projection=projection is not None,
        declared=read_embed_defaults(checkpoint.path),
    )
    return Backbone(
        model,
        config,
        checkpoint,
        preprocess_config(checkpoint.path, config),
        interpolation=interpolation,
        presets=presets,
        preset=preset,
        autocast=autocast,
        projection=projection,
    )


def instantiate_model(
    folder: Path,
    config: ModelConfig,
    *,
    allow_pickle: bool,
    dtype: torch.dtype | None,
) -> torch.nn.Module:
    spec = config.spec
    use_safetensors = check_weights_safe(folder, allow_pickle=allow_pickle)
    if use_safetensors:
        # DINOv2 without transformers' model code: the same network, ~2.5 s less to import (native_dinov2)
        native = load_native(folder, config, dtype or torch.float32)
        if native is not None:
            return native
    import transformers  # lazily: `import transformers` alone costs ~0.7 s; the native path never needs it

    model_class = getattr(transformers, spec.model_class)
    kwargs: dict[str, Any] = {
        "use_safetensors": use_safetensors,
        "trust_remote_code": False,
        "dtype": dtype or torch.float32,
    }
    if spec.name == "vit":
        # A ViT checkpoint without pooler weights would get a randomly initialised tanh pooler.
        kwargs["add_pooling_layer"] = use_safetensors and has_tensor_prefix(folder, "pooler.dense.")
    with _quiet_transformers():  # a CLIP/SigLIP dual encoder reports every text weight as "unexpected"
        model, loading_info = model_class.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    missing = [k for k in loading_info.get("missing_keys", []) if "pooler" not in k and "mask_token" not in k]
    if missing:
        raise ModelNotFoundError(
            f"{folder} does not hold a complete {spec.model_class}: {len(missing)} weights missing "
            f"(e.g. {missing[:3]}); is model_type {config.raw.get('model_type')!r} right?"
        )
    model.eval()
    return model


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
        hf_logging.enable_progress_bar()
