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

    @property
    def location(self) -> str:
        """Where these weights can be loaded from again: the folder, the hub id, or ``embedded``."""
        if self.source == "local":
            return str(self.path)
        return self.name if self.source == "hub" else "embedded"


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
    if not text.strip():
        raise ModelNotFoundError("empty model name: give a checkpoint folder, a hub id or 'embedded'")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is a folder but has no config.json: not a Hugging Face checkpoint"
            )
        return ResolvedCheckpoint(path.resolve(), path.resolve().name, _local_revision(path), "local")
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ModelNotFoundError(
            f"{text} is not a checkpoint folder (expected a folder with config.json){_suggest(text)}"
        )
    return _resolve_hub(text, allow_download=allow_download)


# Hub ids of the families the library knows, for a did-you-mean on a bare name (``dinov2-small``).
KNOWN_HUB_IDS = (
    "facebook/dinov2-small",
    "facebook/dinov2-base",
    "facebook/dinov2-large",
    "facebook/dinov2-giant",
    "facebook/dinov2-with-registers-small",
    "facebook/dinov2-with-registers-base",
    "facebook/dinov3-vits16-pretrain-lvd1689m",
    "google/vit-base-patch16-224-in21k",
    "openai/clip-vit-base-patch32",
    "openai/clip-vit-base-patch16",
    "google/siglip-base-patch16-224",
)
HUB_ID_SHAPE = "hub ids look like 'owner/name', e.g. 'facebook/dinov2-small'"


def _candidates(text: str) -> list[str]:
    """Names a mistyped model reference may have meant: ``embedded``, the known hub ids, the hub ids in the
    local cache, and sibling folders holding a config.json."""
    # a well-formed hub id that is not cached may be right: only the cache's own ids are near misses then
    names = (
        [] if text.count("/") == 1 and not text.startswith((".", "/", "~")) else ["embedded", *KNOWN_HUB_IDS]
    )
    try:
        from huggingface_hub import constants

        hub = Path(constants.HF_HUB_CACHE)
        names += [d.name[len("models--") :].replace("--", "/") for d in hub.glob("models--*")]
    except Exception:  # the cache is a hint only: unreadable means no cached suggestions
        pass
    path = Path(text).expanduser()
    parent = path.parent if str(path.parent) not in ("", ".") or "/" in text else Path(".")
    try:
        for sibling in parent.iterdir():
            if (sibling / "config.json").is_file():
                names.append(str(sibling) if "/" in text else sibling.name)
    except OSError:
        pass
    return list(dict.fromkeys(names))


def _suggest(text: str) -> str:
    """``"; did you mean 'embedded'?"`` for a near miss, else ``""``."""
    import difflib

    names = [name for name in _candidates(text) if name != text]
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.75)
    if not close and "/" not in text:  # a bare repository name: compare with the names after the owner
        tails = {name.rsplit("/", 1)[-1]: name for name in names if "/" in name}
        tail = difflib.get_close_matches(text, list(tails), n=1, cutoff=0.75)
        close = [tails[tail[0]]] if tail else []
    return f"; did you mean {close[0]!r}?" if close else ""


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
        if "/" not in repo_id:  # not a hub id at all: no download can help
            raise ModelNotFoundError(
                f"model {repo_id!r} is not 'embedded', a local checkpoint folder or a hub id "
                f"({HUB_ID_SHAPE}){_suggest(repo_id)}"
            ) from exc
        how = (
            "the hub is unreachable or offline mode is on (HF_HUB_OFFLINE)"
            if offline or "connect" in str(exc).lower() or "resolve" in str(exc).lower()
            else str(exc).splitlines()[0]
        )
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder and is not in the local Hugging Face cache ({how}). "
            f"Get it where the network allows with `hf download {repo_id}` (then copy the cache folder, "
            f"or set HF_HOME to it), or pass the path of a local checkpoint folder; "
            f"'embedded' needs no download from the hub{_suggest(repo_id)}"
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
