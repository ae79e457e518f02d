"""From data to a trained head and its card: pick the features, split, fit, score, describe.

The held-out split is stratified by class (random for segmentation images), seeded, and used for model
selection only: the saved head is fitted on the training split, so the card's validation numbers are the
saved head's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import InvalidOptionError
from ..preprocess import ResizePolicy
from .base import Head
from .card import HEAD_KINDS, HeadCard, HeadKind, precision_label, utc_now
from .compat import check_compatible
from .data import (
    EmbeddingTable,
    read_embedding_parquet,
    read_labelled_folder,
    read_mask,
    read_segmentation_folder,
)
from .features_cache import CacheStats, FeatureCache, cached_features
from .knn import TEMPERATURE, KnnHead, fit_knn
from .linear import LinearHead, fit_softmax
from .patch import IGNORE, PatchHead, check_patch_policy, fit_patch, place_mask

if TYPE_CHECKING:
    from ..backbone import Backbone


@dataclass(frozen=True)
class TrainOptions:
    kind: HeadKind = "linear"
    pooling: str | None = None  # None: the backbone's default ("patch" for patch heads)
    layers: tuple[int, ...] | None = None  # None: the backbone's default blocks
    size: tuple[int, int] | None = None  # None: the backbone's default size
    policy: str | None = None  # None: the backbone's default ("squash" for patch heads)
    preset: str | None = None  # named defaults for the options not given (None: the backbone's)
    val_fraction: float = 0.2
    seed: int = 0
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise InvalidOptionError(
                f"unknown head kind {self.kind!r}; choose one of {', '.join(HEAD_KINDS)}"
            )
        if not 0.0 <= self.val_fraction < 1.0:
            raise InvalidOptionError(f"val_fraction must be in [0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class TrainResult:
    head: Head
    cache: CacheStats = field(default_factory=CacheStats)

    @property
    def card(self) -> HeadCard:
        return self.head.card


def is_parquet_source(path: str | Path) -> bool:
    path = Path(path).expanduser()
    return path.suffix == ".parquet" or (path.is_dir() and any(path.glob("*.parquet")))


def split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices, stratified: each class with ≥ 2 items gives round(n * fraction) ≥ 1 to val."""
    rng = np.random.default_rng(seed)
    train: list[int] = []
    val: list[int] = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_val = val_count(len(members), val_fraction)
        val += members[:n_val].tolist()
        train += members[n_val:].tolist()
    return np.sort(np.asarray(train, dtype=np.int64)), np.sort(np.asarray(val, dtype=np.int64))


def val_count(n: int, val_fraction: float) -> int:
    """round(n * fraction), but at least 1 and leaving at least 1 for training when n ≥ 2."""
    if val_fraction <= 0 or n < 2:
        return 0
    return min(max(round(n * val_fraction), 1), n - 1)


def train_head(
    backbone: Backbone | None,
    data: str | Path,
    options: TrainOptions,
    *,
    cache: FeatureCache | None = None,
) -> TrainResult:
    """Train a head on a labelled folder, a segmentation folder (``kind="patch"``) or catalog Parquet.

    Parquet input needs no backbone; given one, the vectors' backbone must be it."""
    if is_parquet_source(data):
        return TrainResult(train_from_embeddings(read_embedding_parquet(data), options, str(data), backbone))
    if backbone is None:
        raise InvalidOptionError("training on images needs a backbone")
    # the preset's box when none is asked for, stored in the card so that prediction prepares alike
    dense = "patch" if options.kind == "patch" else None  # per-patch heads keep the native box
    options = dataclasses.replace(options, size=backbone.choose_size(options.size, options.preset, dense))
    if options.kind == "patch":
        return _train_patch(backbone, Path(data), options, cache)
    return _train_classifier(backbone, Path(data), options, cache)


@dataclass(frozen=True)
class CardFacts:
    """What a head's card says about its features and data, whatever the head kind fitted on them."""

    backbone: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: tuple[int, ...] | None
    size: tuple[int, int] | None
    policy: str | None
    normalized: bool
    feature_dim: int
    classes: tuple[str, ...]
    train_count: int
    val_count: int
    data: str
    precision: str | None
    interpolation: str | None
    preset: str | None

    @classmethod
    def of_backbone(
        cls,
        backbone: Backbone,
        options: TrainOptions,
        *,
        pooling: str,
        layers: list[int] | None,
        policy: str,
        feature_dim: int,
        classes: tuple[str, ...],
        train_count: int,
        val_count: int,
        data: str,
    ) -> CardFacts:
        return cls(
            backbone=backbone.checkpoint.name,
            revision=backbone.checkpoint.revision,
            preprocess_hash=backbone.preprocess_config.hash(),
            pooling=pooling,
            layers=None if layers is None else tuple(layers),
            size=options.size,
            policy=policy,
            normalized=False,
            feature_dim=feature_dim,
            classes=classes,
            train_count=train_count,
            val_count=val_count,
            data=data,
            precision=precision_label(backbone.autocast),
            interpolation=backbone.info_interpolation,
            preset=backbone.preset_defaults(options.preset).preset,
        )

    def card(
        self,
        kind: HeadKind,
        *,
        val_accuracy: float | None,
        hyperparameters: dict[str, Any],
        val_miou: float | None = None,
    ) -> HeadCard:
        return HeadCard(
            kind=kind,
            val_accuracy=val_accuracy,
            val_miou=val_miou,
            hyperparameters=hyperparameters,
            created=utc_now(),
            **asdict(self),
        )


def _layers(backbone: Backbone, options: TrainOptions) -> list[int] | None:
    """The layers a head is trained on: the options', else the backbone's defaults."""
    defaults = backbone.preset_defaults(options.preset)
    return backbone.resolve_layers(options.layers if options.layers is not None else defaults.layers)


def _features(
    backbone: Backbone,
    files: Sequence[Path],
    options: TrainOptions,
    cache: FeatureCache | None,
    *,
    pooling: str,
    layers: list[int] | None,
    policy: str,
) -> tuple[list[np.ndarray], CacheStats]:
    """Every file's training feature (at the options' size and batch size), and how many the cache held."""
    stats = CacheStats()
    features = cached_features(
        backbone,
        files,
        pooling=pooling,
        layers=layers,
        size=options.size,
        policy=policy,
        cache=cache,
        batch_size=options.batch_size,
        stats=stats,
    )
    return features, stats


def _train_classifier(
    backbone: Backbone, folder: Path, options: TrainOptions, cache: FeatureCache | None
) -> TrainResult:
    from ..pooling import check_pooling

    pooling = check_pooling(options.pooling or backbone.preset_defaults(options.preset).pooling)
    if pooling == "patch":
        raise InvalidOptionError("pooling='patch' gives a grid per image: use --kind patch for dense heads")
    layers = _layers(backbone, options)
    policy = backbone.check_policy(options.policy, options.preset)
    dataset = read_labelled_folder(folder)
    features, stats = _features(
        backbone, dataset.paths, options, cache, pooling=pooling, layers=layers, policy=policy
    )
    x = np.stack(features)  # [N, F]
    y = np.asarray(dataset.labels, dtype=np.int64)
    train, val = split(y, options.val_fraction, options.seed)
    facts = CardFacts.of_backbone(
        backbone,
        options,
        pooling=pooling,
        layers=layers,
        policy=policy,
        feature_dim=int(x.shape[1]),
        classes=dataset.classes,
        train_count=len(train),
        val_count=len(val),
        data=str(folder),
    )
    head = _fit_classifier(options, x[train], y[train], x[val], y[val], facts)
    return TrainResult(head, stats)


def _fit_classifier(
    options: TrainOptions,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    facts: CardFacts,
) -> Head:
    num_classes = len(facts.classes)
    if options.kind == "linear":
        fit = fit_softmax(x_train, y_train, x_val, y_val, num_classes)
        card = facts.card(
            "linear",
            val_accuracy=fit.val_accuracy,
            hyperparameters={
                "weight_decay": fit.weight_decay,
                "weight_decay_grid": fit.tried,
                "optimizer": "lbfgs",
                "standardize": True,
            },
        )
        return LinearHead(card, fit.params)
    if options.kind == "knn":
        knn = fit_knn(x_train, y_train, x_val, y_val, num_classes)
        card = facts.card(
            "knn",
            val_accuracy=knn.val_accuracy,
            hyperparameters={"k": knn.k, "temperature": TEMPERATURE, "k_grid": knn.tried},
        )
        return KnnHead(card, knn.bank, knn.labels, k=knn.k, temperature=TEMPERATURE)
    raise InvalidOptionError(f"kind {options.kind!r} is not a classifier")


def train_from_embeddings(
    table: EmbeddingTable, options: TrainOptions, source: str, backbone: Backbone | None = None
) -> Head:
    """Linear or kNN head on catalog vectors; the card's feature facts are the catalog's metadata."""
    if options.kind == "patch":
        raise InvalidOptionError("patch heads need images and masks; Parquet holds one vector per image")
    given = {
        "pooling": options.pooling,
        "layers": options.layers,
        "size": options.size,
        "policy": options.policy,
    }
    fixed = sorted(name for name, value in given.items() if value is not None)
    if fixed:
        raise InvalidOptionError(
            f"{', '.join(fixed)} cannot be chosen for Parquet input: the catalog fixed its features "
            f"(pooling={table.meta['pooling']}, layers={table.meta['layers']})"
        )
    meta = table.meta
    y = np.asarray(table.labels, dtype=np.int64)
    train, val = split(y, options.val_fraction, options.seed)
    size = meta.get("size")
    precision = meta.get("precision")
    interpolation = meta.get("interpolation")
    facts = CardFacts(
        backbone=str(meta["model"]),
        revision=str(meta["revision"]),
        preprocess_hash=str(meta["preprocess_hash"]),
        pooling=str(meta["pooling"]),
        layers=None if meta["layers"] is None else tuple(int(i) for i in meta["layers"]),
        size=None if size is None else (int(size[0]), int(size[1])),
        policy=meta.get("policy"),
        normalized=bool(meta["normalized"]),
        feature_dim=int(meta["dim"]),
        classes=table.classes,
        train_count=len(train),
        val_count=len(val),
        data=source,
        precision=precision_label(precision) if precision else None,  # optional in the catalog's metadata
        interpolation=str(interpolation) if interpolation else None,
        preset=str(meta["preset"]) if meta.get("preset") else None,
    )
    x = table.features
    head = _fit_classifier(options, x[train], y[train], x[val], y[val], facts)
    if backbone is not None:
        check_compatible(head.card, backbone, what=f"a head on the vectors in {source!r}")
    return head


def _train_patch(
    backbone: Backbone, folder: Path, options: TrainOptions, cache: FeatureCache | None
) -> TrainResult:
    if options.pooling not in (None, "patch"):
        raise InvalidOptionError(
            f"patch heads read the patch grid; pooling={options.pooling!r} does not apply"
        )
    policy = options.policy or "squash"
    check_patch_policy(policy)
    layers = _layers(backbone, options)
    dataset = read_segmentation_folder(folder)
    features, stats = _features(
        backbone, dataset.images, options, cache, pooling="patch", layers=layers, policy=policy
    )
    masks = [read_mask(m) for m in dataset.masks]
    sources = _source_sizes(dataset.images)
    for image, mask, prepared_size in zip(dataset.images, masks, sources, strict=True):
        if mask.shape != prepared_size:
            raise InvalidOptionError(
                f"mask of {image} is {mask.shape[1]}x{mask.shape[0]}, the image {prepared_size[1]}x"
                f"{prepared_size[0]}: a mask must have its image's size"
            )
    pre, typed_policy = backbone.preprocessor, cast(ResizePolicy, policy)
    # pad: each mask goes where its image is in the letterbox; letterbox pixels are IGNORE (patch.place_mask)
    masks = [
        place_mask(
            mask,
            pre.target_size(typed_policy, options.size, source),
            pre.image_box(typed_policy, options.size, source),
        )
        for mask, source in zip(masks, sources, strict=True)
    ]
    order = np.random.default_rng(options.seed).permutation(len(masks))
    n_val = val_count(len(masks), options.val_fraction)
    val, train = np.sort(order[:n_val]), np.sort(order[n_val:])
    num_classes = len(dataset.classes)
    fit = fit_patch(
        [features[i] for i in train],
        [masks[i] for i in train],
        [features[i] for i in val],
        [masks[i] for i in val],
        num_classes,
    )
    facts = CardFacts.of_backbone(
        backbone,
        options,
        pooling="patch",
        layers=layers,
        policy=policy,
        feature_dim=int(features[0].shape[-1]),
        classes=dataset.classes,
        train_count=len(train),
        val_count=len(val),
        data=str(folder),
    )
    card = facts.card(
        "patch",
        val_accuracy=None if fit.val_score is None else fit.val_score.pixel_accuracy,
        val_miou=None if fit.val_score is None else fit.val_score.miou,
        hyperparameters={
            "weight_decay": fit.weight_decay,
            "weight_decay_grid": fit.tried,
            "optimizer": "lbfgs",
            "standardize": True,
            "ignore_value": IGNORE,
            "mask_to_grid": "area vote",
        },
    )
    return TrainResult(PatchHead(card, fit.params), stats)


def _source_sizes(images: tuple[Path, ...]) -> list[tuple[int, int]]:
    """(H, W) of each image as decoded (EXIF orientation applied), read from the header only."""
    from PIL import Image

    sizes = []
    for path in images:
        with Image.open(path) as img:
            width, height = img.size
            if img.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that swap the sides
                width, height = height, width
        sizes.append((height, width))
    return sizes
