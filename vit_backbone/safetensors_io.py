"""Reading safetensors checkpoints without loading tensors: headers, shards, exact parameter counts.

A safetensors file is an 8-byte little-endian header length, a JSON header (names, dtypes, shapes,
offsets), then raw bytes; reading only the header is instant even for multi-GB checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from .errors import ModelNotFoundError, UnsafeCheckpointError

_MAX_SAFETENSORS_HEADER = 100_000_000  # the limit the safetensors format itself enforces


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of one safetensors file (8-byte little-endian length, then JSON); no tensor bytes
    are read, so this is instant even for multi-GB checkpoints."""
    file = Path(path)
    try:
        with file.open("rb") as handle:
            head = handle.read(8)
            size = os.fstat(handle.fileno()).st_size
            if len(head) != 8:
                raise UnsafeCheckpointError(f"{file} is not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_SAFETENSORS_HEADER or 8 + length > size:
                raise UnsafeCheckpointError(f"{file} has an implausible safetensors header ({length} bytes)")
            raw = handle.read(length)
    except FileNotFoundError as exc:
        raise ModelNotFoundError(f"{file} does not exist") from exc
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsafeCheckpointError(f"{file} has a safetensors header that is not JSON") from exc
    if not isinstance(header, dict):
        raise UnsafeCheckpointError(f"{file} has a safetensors header that is not a JSON object")
    return header


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ModelNotFoundError(f"{path} is neither a safetensors file nor a checkpoint folder")
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UnsafeCheckpointError(f"{index[0]} is not a valid safetensors index") from exc
        return [path / name for name in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} holds no *.safetensors file")
    return files


def count_params_from_safetensors(path: str | os.PathLike[str], *, prefix: str = "") -> int:
    """Exact element count of a real checkpoint from its safetensors headers alone.

    ``path`` is a ``.safetensors`` file or a checkpoint folder (sharded folders are read through their
    index). ``prefix`` keeps only tensors whose names start with it, e.g. ``"vision_model."`` for the vision
    tower of a full CLIP/SigLIP checkpoint.
    """
    total = 0
    for file in _safetensors_files(Path(path)):
        for name, info in read_safetensors_header(file).items():
            if name == "__metadata__" or not name.startswith(prefix):
                continue
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise UnsafeCheckpointError(f"{file}: tensor {name!r} has no valid shape")
            total += math.prod(shape)
    return total
