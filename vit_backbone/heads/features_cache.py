"""Frozen features, computed once per image and kept on disk.

Training a head is cheap; the forward passes are not. Each image's feature is stored under a key made of
the file's content hash (SHA-256 of its bytes, so renaming or copying a file costs nothing and editing it
invalidates it) and the facts that decide the numbers: backbone revision, preprocessing hash, pooling,
blocks, size, policy, position rule, weights' dtype and autocast dtype. Retraining with another head kind
or other hyperparameters reuses every feature. Files are written to a temporary name and renamed (a crash
never leaves half an array).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ImageDecodeError
from ..preprocess_config import literal_size

if TYPE_CHECKING:
    from ..backbone import Backbone
    from ..preprocess import Prepared

_CHUNK = 64  # images decoded and embedded per step: bounds memory for big folders


@dataclass(frozen=True)
class FeatureKey:
    revision: str
    preprocess_hash: str
    pooling: str
    layers: tuple[int, ...] | None
    size: tuple[int, int] | None
    policy: str
    interpolation: str
    autocast: str | None
    dtype: str  # the weights' dtype (a float16 copy of a checkpoint makes other features)

    @classmethod
    def of(
        cls,
        backbone: Backbone,
        *,
        pooling: str,
        layers: Sequence[int] | None,
        size: tuple[int, int] | None,
        policy: str,
    ) -> FeatureKey:
        return cls(
            revision=backbone.checkpoint.revision,
            preprocess_hash=backbone.preprocess_config.hash(),
            pooling=pooling,
            layers=None if layers is None else tuple(layers),
            size=size,
            policy=policy,
            interpolation=backbone.info_interpolation,
            autocast=None if backbone.autocast is None else str(backbone.autocast).removeprefix("torch."),
            dtype=str(backbone.dtype).removeprefix("torch."),
        )

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_hash(path: Path) -> str:
    """SHA-256 of a file, read in blocks: hashing a folder never holds more than one block in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FeatureCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def _path(self, key: FeatureKey, digest: str) -> Path:
        return self.root / key.digest() / digest[:2] / f"{digest}.npy"

    def get(self, key: FeatureKey, digest: str) -> np.ndarray | None:
        path = self._path(key, digest)
        if not path.is_file():
            return None
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError):  # a damaged entry is recomputed, not trusted
            return None

    def put(self, key: FeatureKey, digest: str, array: np.ndarray) -> None:
        path = self._path(key, digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        facts = self.root / key.digest() / "key.json"
        if not facts.is_file():
            facts.write_text(json.dumps(asdict(key), indent=2, sort_keys=True))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as handle:
            np.save(handle, np.ascontiguousarray(array), allow_pickle=False)
        os.replace(tmp, path)


@dataclass
class CacheStats:
    hits: int = 0
    computed: int = 0


def cached_features(
    backbone: Backbone,
    files: Sequence[Path],
    *,
    pooling: str,
    layers: Sequence[int] | None,
    size: tuple[int, int] | None,
    policy: str,
    cache: FeatureCache | None,
    batch_size: int = 8,
    stats: CacheStats | None = None,
) -> list[np.ndarray]:
    """One float32 feature per file, in order ([F], or [h, w, F] for ``pooling="patch"``)."""
    from ..pooling import check_pooling

    chosen = check_pooling(pooling)
    stats = stats if stats is not None else CacheStats()
    key = FeatureKey.of(backbone, pooling=chosen, layers=layers, size=size, policy=policy)
    results: list[np.ndarray | None] = [None] * len(files)
    missing: list[tuple[int, Path]] = []  # no bytes kept: a chunk's files are read again when it is embedded
    for index, file in enumerate(files):
        found = cache.get(key, file_hash(Path(file))) if cache is not None else None
        if found is not None:
            results[index] = found
            stats.hits += 1
        else:
            missing.append((index, Path(file)))
    for start in range(0, len(missing), _CHUNK):
        chunk: list[tuple[int, str, Prepared]] = []
        for index, path in missing[start : start + _CHUNK]:
            data = path.read_bytes()  # hashed again: the key is what was embedded, even if the file changed
            chunk.append((index, content_hash(data), _prepare(backbone, path, data, size, policy)))
        prepared = [p for _, _, p in chunk]
        grids = {p.grid for p in prepared}
        if chosen == "patch" and len(grids) > 1:  # one array per image: embed grids one by one
            vectors = [
                backbone.embed_prepared([p], pooling=chosen, layers=layers, batch_size=batch_size)[0]
                for p in prepared
            ]
        else:
            vectors = list(
                backbone.embed_prepared(prepared, pooling=chosen, layers=layers, batch_size=batch_size)
            )
        for (index, digest, _), vector in zip(chunk, vectors, strict=True):
            array = np.asarray(vector, dtype=np.float32)
            if cache is not None:
                cache.put(key, digest, array)
            results[index] = array
            stats.computed += 1
    return [r for r in results if r is not None]


def _prepare(
    backbone: Backbone, path: Path, data: bytes, size: tuple[int, int] | None, policy: str
) -> Prepared:
    """One image, or an error that names its file (a training set must not shrink silently)."""
    try:
        # the size as trained (None: the native box), never a preset's
        return backbone.prepare(data, size=literal_size(size), policy=backbone.check_policy(policy))[0]
    except ImageDecodeError as exc:
        raise ImageDecodeError(f"{path}: {exc}", code=exc.code) from exc
