"""Checkpoint resolution and loading: a local folder, a hub id from the local cache, or ``embedded``.

Weights load from safetensors only unless pickle is explicitly allowed, and never through remote code:
the transformers class comes from our family spec, not from the checkpoint's ``auto_map``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers

from .errors import ModelNotFoundError, UnsafeCheckpointError
from .safetensors_io import read_safetensors_header
from .specs import FamilySpec, family_for

log = logging.getLogger(__name__)

CheckpointSource = Literal["local", "hub", "embedded"]
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ResolvedCheckpoint:
    path: Path  # folder with config.json and *.safetensors
    name: str
    revision: str
    source: CheckpointSource


def resolve_checkpoint(
    name_or_path: str | Path, *, cache_dir: Path | None = None, allow_download: bool = True
) -> ResolvedCheckpoint:
    """Find the folder behind a model reference without loading any weights."""
    text = str(name_or_path)
    if text == "embedded":
        from .embedded import ensure_embedded_checkpoint

        folder = ensure_embedded_checkpoint(cache_dir, download=allow_download)
        meta = json.loads((folder / "vitembed.json").read_text())
        return ResolvedCheckpoint(folder, str(meta["name"]), str(meta["revision"]), "embedded")
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder but has no config.json: not a Hugging Face checkpoint"
            )
        return ResolvedCheckpoint(path.resolve(), path.resolve().name, _local_revision(path), "local")
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFoundError(f"{text} is not a checkpoint folder (expected a folder with config.json)")
    return _resolve_hub(text, allow_download=allow_download)


def _resolve_hub(repo_id: str, *, allow_download: bool) -> ResolvedCheckpoint:
    import huggingface_hub
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE) or not allow_download
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.md"],
            local_files_only=offline,
        )
    except Exception as exc:  # the hub client raises many types for "not here / not reachable"
        how = (
            "the hub is unreachable or offline mode is on (HF_HUB_OFFLINE)"
            if offline or "connect" in str(exc).lower() or "resolve" in str(exc).lower()
            else str(exc).splitlines()[0]
        )
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder and is not in the local Hugging Face cache ({how}). "
            f"Get it where the network allows with `hf download {repo_id}` (then copy the cache folder, "
            f"or set HF_HOME to it), or pass the path of a local checkpoint folder; "
            f"'embedded' needs no download from the hub."
        ) from exc
    path = Path(folder)
    return ResolvedCheckpoint(path, repo_id, path.name, "hub")


def _local_revision(path: Path) -> str:
    """A content fingerprint cheap enough for multi-GB checkpoints: config bytes plus, per weight file,
    its size, mtime and safetensors header (names, dtypes, shapes, offsets). Hashing every weight byte
    would cost seconds per GB at every start."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        digest.update(json.dumps(read_safetensors_header(weights), sort_keys=True).encode())
    return "local-" + digest.hexdigest()[:12]


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelNotFoundError(f"cannot read {folder / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelNotFoundError(f"{folder / 'config.json'} is not a JSON object")
    return config


def read_processor_config(folder: Path) -> dict[str, Any] | None:
    file = folder / "preprocessor_config.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) else None


def check_weights_safe(folder: Path, *, allow_pickle: bool) -> bool:
    """True if the folder holds safetensors; refuse pickle-only folders unless allowed."""
    if any(folder.glob("*.safetensors")):
        return True
    pickles = [p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if pickles and not allow_pickle:
        raise UnsafeCheckpointError(
            f"{folder} holds only pickle weights ({', '.join(sorted(pickles))}); "
            f"pickle can run code on load. "
            f"Convert them to safetensors, or pass allow_pickle=True if you trust the file."
        )
    if not pickles:
        raise ModelNotFoundError(f"{folder} has a config.json but no weight files (*.safetensors)")
    return False


def _has_tensor_prefix(folder: Path, prefix: str) -> bool:
    for weights in folder.glob("*.safetensors"):
        header = read_safetensors_header(weights)
        if any(key.startswith(prefix) or f".{prefix}" in key for key in header):
            return True
    return False


def instantiate_model(
    folder: Path,
    spec: FamilySpec,
    config: dict[str, Any],
    *,
    allow_pickle: bool,
    dtype: torch.dtype | None,
) -> torch.nn.Module:
    use_safetensors = check_weights_safe(folder, allow_pickle=allow_pickle)
    model_class = getattr(transformers, spec.model_class)
    kwargs: dict[str, Any] = {
        "use_safetensors": use_safetensors,
        "trust_remote_code": False,
        "dtype": dtype or torch.float32,
    }
    if spec.name == "vit":
        # A ViT checkpoint without pooler weights would get a randomly initialised tanh pooler.
        kwargs["add_pooling_layer"] = use_safetensors and _has_tensor_prefix(folder, "pooler.dense.")
    with _quiet_transformers():  # a CLIP/SigLIP dual encoder reports every text weight as "unexpected"
        model, loading_info = model_class.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    missing = [k for k in loading_info.get("missing_keys", []) if "pooler" not in k and "mask_token" not in k]
    if missing:
        raise ModelNotFoundError(
            f"{folder} does not hold a complete {spec.model_class}: {len(missing)} weights missing "
            f"(e.g. {missing[:3]}); is model_type {config.get('model_type')!r} right?"
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


def load_spec(folder: Path) -> tuple[FamilySpec, dict[str, Any]]:
    config = read_config(folder)
    return family_for(config), config
