"""``CatalogMeta``: the facts that decide what a catalog's vectors mean, stored with every shard.

A vector is only comparable with another one made by the same weights (revision), the same pixels
(preprocessing hash, policy, size) and the same pooling (pooling, layers, normalisation). The catalog job
writes these facts into every Parquet shard's key-value metadata (key ``b"vitembed"``) and into
``catalog.json``; readers (the index, search, a resumed job) compare them instead of trusting file names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from vit_backbone.catalog.errors import CatalogError

META_KEY = b"vitembed"  # Parquet key-value metadata key holding the CatalogMeta JSON
FORMAT_VERSION = 1
DTYPES = ("float32", "float16")
# what makes two sets of vectors comparable (see embed_options_mismatch)
OPTIONAL = ("format_version", "precision", "preset", "model_location")  # keys a catalog's JSON may lack
COMPARED = ("revision", "preprocess_hash", "pooling", "layers", "size", "policy", "normalized", "dim")


@dataclass(frozen=True)
class CatalogMeta:
    model: str  # the name the user gave (e.g. "embedded" or a folder name)
    revision: str  # Backbone.checkpoint.revision
    preprocess_hash: str  # Backbone.preprocess_config.hash()
    pooling: str
    layers: list[int] | None  # 0-based block indices as resolved by the backbone; None = last block
    size: list[int] | None  # [h, w] requested, or None = the model's default
    policy: str
    normalized: bool
    dim: int
    dtype: str  # "float32" | "float16": how the vectors are stored
    format_version: int = FORMAT_VERSION
    # compute precision the vectors were made in ("float32", "bfloat16", …); informational, not compared:
    # bfloat16 vectors keep cosine ≥ 0.999 to float32 ones. None: a catalog written before it was recorded.
    precision: str | None = None
    # the named defaults (vit_backbone.presets) that filled in the options not given; informational (the
    # options themselves are stored resolved and compared). None: written before presets existed.
    preset: str | None = None
    # where the weights were loaded from when the catalog was made (a checkpoint folder, a hub id or
    # "embedded"), so that `vitembed search` can load them again without --model; informational and left out
    # of comparisons (a moved folder holds the same weights). None: written before it was recorded.
    model_location: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CatalogError(f"catalog dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise CatalogError(f"catalog dim must be a positive int, got {self.dim!r}")
        if self.precision is not None and not isinstance(self.precision, str):
            raise CatalogError(f"catalog precision must be a string or null, got {self.precision!r}")
        if self.size is not None and len(self.size) != 2:
            raise CatalogError(f"catalog size must be [h, w] or null, got {self.size!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CatalogMeta:
        """Unknown keys are ignored (catalog.json adds the job's arguments); a missing required one is an
        error; ``precision`` (added later) may be absent."""
        if not isinstance(raw, dict):
            raise CatalogError(f"catalog metadata must be a JSON object, got {type(raw).__name__}")
        version = raw.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise CatalogError(
                f"catalog format_version {version!r} is not supported by this vitembed "
                f"(it reads version {FORMAT_VERSION}); upgrade vitembed or re-embed the catalog"
            )
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in raw and n not in OPTIONAL]
        if missing:
            raise CatalogError(f"catalog metadata lacks {', '.join(missing)}")
        values = {n: raw[n] for n in names if n in raw}
        for key in ("layers", "size"):
            if values[key] is not None:
                values[key] = [int(v) for v in values[key]]
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> CatalogMeta:
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CatalogError(f"catalog metadata is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def embed_options_mismatch(self, other: CatalogMeta) -> list[str]:
        """Human-readable differences in what makes vectors comparable, e.g. ``["pooling: cls != mean"]``.

        Compared: revision, preprocessing hash, pooling, layers, size, policy, normalisation and dim. Not
        compared: the model *name* (the same weights may be called ``embedded`` or by a folder), the
        storage dtype (float16 and float32 copies of the same vectors are comparable) and the compute
        precision (informational).
        """
        differences = []
        for name in COMPARED:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                differences.append(f"{name}: {_show(mine)} != {_show(theirs)}")
        return differences


def _show(value: Any) -> str:
    if value is None:
        return "default"
    return value if isinstance(value, str) else json.dumps(value)
