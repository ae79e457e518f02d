"""The head card: everything needed to know what a trained head expects and how good it was.

A head is only meaningful on the exact features it was trained on: the same checkpoint (revision), the
same pixels (preprocessing hash, resize policy, size), the same tokens (pooling, blocks) and the same
normalisation. The card records all of them next to the weights, so that loading a head against anything
else is refused (``compat.check_compatible``) instead of silently producing wrong probabilities.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Literal, get_args

from ..errors import InvalidOptionError

HeadKind = Literal["linear", "knn", "patch"]
HEAD_KINDS: tuple[str, ...] = get_args(HeadKind)
CARD_FORMAT = 1


@dataclass(frozen=True)
class HeadCard:
    kind: HeadKind
    backbone: str  # the checkpoint's name when trained (informative; binding uses revision + hash)
    revision: str
    preprocess_hash: str
    pooling: str
    layers: tuple[int, ...] | None  # 0-based blocks as resolved at training time; None = last block
    size: tuple[int, int] | None  # (H, W) asked for at training time; None = the backbone's default
    policy: str | None  # resize policy; None = the backbone's default
    normalized: bool  # features are L2-normalised before the head (catalog embeddings written normalised)
    feature_dim: int  # F per image ([F]) or per patch for kind="patch"
    classes: tuple[str, ...]  # class id i is classes[i]
    val_accuracy: float | None  # on the held-out split (per pixel for patch heads); None without one
    val_miou: float | None = None  # patch heads: mean IoU over classes present in the held-out masks
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # what the held-out split chose
    train_count: int = 0  # images (or catalog rows) the head was fitted on
    val_count: int = 0
    data: str = ""  # where the training data came from (folder or Parquet path)
    created: str = ""  # ISO 8601, UTC
    format: int = CARD_FORMAT
    # compute precision of the training features: "float32", "bfloat16", "float16"; None = not recorded
    # (older cards, catalogs written before they recorded it). Informational: a server in another precision
    # runs the head with a warning (probabilities differ by ~1e-3, see the README), it does not refuse it.
    precision: str | None = None
    # position-table rule the features were made with ("transformers", ..., "rope"); None = not recorded.
    # A backbone with another rule makes other features at non-native sizes: load_head refuses it.
    interpolation: str | None = None
    # the named defaults (vit_backbone.presets) that filled in the options not given; None: a card written
    # before presets (its options are stored resolved; an unrecorded policy was default-v1's)
    preset: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise InvalidOptionError(
                f"unknown head kind {self.kind!r}; choose one of {', '.join(HEAD_KINDS)}"
            )
        if len(self.classes) < 2:
            raise InvalidOptionError(f"a head needs at least 2 classes, got {len(self.classes)}")
        if len(set(self.classes)) != len(self.classes):
            raise InvalidOptionError("class names must be unique")
        if self.feature_dim < 1:
            raise InvalidOptionError(f"feature_dim must be positive, got {self.feature_dim}")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("layers", "size", "classes"):
            out[key] = None if out[key] is None else list(out[key])
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, raw: Any) -> HeadCard:
        if not isinstance(raw, dict):
            raise InvalidOptionError("a head card must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidOptionError(f"unknown head card field(s) {unknown}; written by a newer vitembed?")
        if raw.get("format", CARD_FORMAT) != CARD_FORMAT:
            raise InvalidOptionError(f"head card format {raw.get('format')!r} is not supported")
        values = dict(raw)
        try:
            if values.get("layers") is not None:
                values["layers"] = tuple(int(i) for i in values["layers"])
            if values.get("size") is not None:
                height, width = values["size"]
                values["size"] = (int(height), int(width))
            values["classes"] = tuple(str(c) for c in values["classes"])
            return cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidOptionError(f"invalid head card: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> HeadCard:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidOptionError(f"the head card is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def precision_label(autocast: object) -> str:
    """``None`` (plain float32) or a torch dtype / its name → "float32" | "bfloat16" | "float16"."""
    if autocast is None:
        return "float32"
    return str(autocast).removeprefix("torch.").split()[0]


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()
