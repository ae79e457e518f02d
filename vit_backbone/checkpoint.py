"""Checkpoint resolution: a local folder, a hub id from the local cache, or ``embedded``, and what its files
say before any weights load (its parsed config, its processor config, its revision and preprocessing hash).

Nothing here imports torch or transformers, so ``vitembed inspect`` and start-up checks stay fast; loading
the weights is :mod:`vit_backbone.loading`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from .errors import ModelLoadError, ModelNotFoundError, UnsafeCheckpointError
from .model_config import ModelConfig
from .preprocess_config import PreprocessConfig
from .safetensors_io import read_safetensors_header
from .specs import parse_config

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
    file = folder / "config.json"
    try:
        config = json.loads(file.read_bytes())
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"{folder} has no config.json") from exc
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read {file}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"not valid JSON: {exc}", path=str(file)) from exc
    if not isinstance(config, dict):
        raise ModelLoadError("is not a JSON object", path=str(file))
    return config


def read_processor_config(folder: Path) -> dict[str, Any] | None:
    file = folder / "preprocessor_config.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) else None


def read_embed_defaults(folder: Path) -> dict[str, Any]:
    """The embed ``defaults`` a checkpoint's ``vitembed.json`` declares (the embedded model's measured
    choices: pooling, layers, policy); empty when it has none."""
    meta_file = folder / "vitembed.json"
    if not meta_file.is_file():
        return {}
    defaults = json.loads(meta_file.read_text()).get("defaults") or {}
    return dict(defaults) if isinstance(defaults, dict) else {}


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


def has_tensor_prefix(folder: Path, prefix: str) -> bool:
    """Whether any safetensors file of the folder holds a tensor named ``prefix...`` (at any nesting)."""
    for weights in folder.glob("*.safetensors"):
        header = read_safetensors_header(weights)
        if any(key.startswith(prefix) or f".{prefix}" in key for key in header):
            return True
    return False


def load_config(folder: Path) -> ModelConfig:
    """The folder's ``config.json``, parsed with its family's transformers defaults filled in."""
    return parse_config(read_config(folder), source=str(folder / "config.json"))


def preprocess_config(folder: Path, config: ModelConfig) -> PreprocessConfig:
    """The checkpoint's own preprocessing, or its family's default when it ships no processor config."""
    processor = read_processor_config(folder)
    return PreprocessConfig.from_processor_dict(processor or dict(config.spec.default_processor))


class CheckpointFacts(NamedTuple):
    """What decides whether two vectors live in the same space: the weights and the pixels fed to them."""

    revision: str
    preprocess_hash: str


def models_matching(served: Mapping[str, CheckpointFacts], revision: str, preprocess_hash: str) -> list[str]:
    """The served models (name -> facts) whose revision and preprocessing hash are the ones asked for:
    those whose vectors a table, a head or a query can be compared with."""
    return [model for model, facts in served.items() if facts == (revision, preprocess_hash)]


def checkpoint_facts(target: str | Path, cache_dir: Path | None = None) -> CheckpointFacts:
    """(revision, preprocessing hash) of a model reference, read from its files without loading weights."""
    checkpoint = resolve_checkpoint(target, cache_dir=cache_dir)
    config = load_config(checkpoint.path)
    return CheckpointFacts(checkpoint.revision, preprocess_config(checkpoint.path, config).hash())
