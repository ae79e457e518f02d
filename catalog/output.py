"""Opening a catalog folder for a job: the options it was started with, and what is already done.

``catalog.json`` is written when a job first starts in a folder and pins everything that decides the
vectors (``CatalogMeta``) plus the job's source and precision. A rerun with the same arguments resumes —
committed shard rows and recorded failures are skipped, temporary files of an interrupted shard write are
deleted — and a rerun with different ones is refused, naming each difference, because one folder must
never mix vectors that are not comparable.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vit_backbone.backbone import Backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.pooling import check_pooling

from .error_log import ErrorLog
from .errors import CatalogError
from .meta import DTYPES, CatalogMeta
from .shards import (
    committed_ids,
    fsync_dir,
    next_shard_index,
    read_shard_meta,
    remove_partial_shards,
    shard_paths,
)
from .sources import Source

CATALOG_FILE = "catalog.json"


@dataclass(frozen=True)
class EmbedSpec:
    """The embedding options as the user gave them (None = the model's default)."""

    pooling: str | None = None
    layers: tuple[int, ...] | None = None
    size: tuple[int, int] | None = None
    policy: str | None = None
    normalize: bool = False
    dtype: str = "float32"
    precision: str = "auto"


@dataclass(frozen=True)
class JobRecord:
    """What ``catalog.json`` holds besides the meta: enough to recognise "the same job" on a rerun."""

    source: str
    source_kind: str
    extra_columns: list[str]
    precision: str  # as asked: auto | float32 | bfloat16
    precision_used: str  # what auto resolved to on the first run; reused when resuming
    items: int  # items in the source when the job first started (for information)


@dataclass
class OutputState:
    folder: Path
    meta: CatalogMeta
    record: JobRecord
    done: set[str] = field(default_factory=set)  # ids in committed shards or errors.jsonl
    rows_before: int = 0  # rows already committed when this run started
    failures_before: int = 0
    next_shard: int = 0
    resumed: bool = False


def resolve_meta(backbone: Backbone, model: str, spec: EmbedSpec) -> CatalogMeta:
    """Apply the model's defaults and validate every option before any image is read."""
    pooling = check_pooling(spec.pooling or backbone.defaults.pooling)
    if pooling == "patch":
        raise InvalidOptionError(
            "pooling='patch' gives a grid per image, not one vector; a catalog stores one vector per image "
            "(use mean, gem, cls or cls_mean)"
        )
    requested = list(spec.layers) if spec.layers is not None else backbone.defaults.layers
    layers = backbone.resolve_layers(requested)
    policy = backbone.check_policy(spec.policy)
    if spec.size is not None:  # a size no image can satisfy is refused now, with the nearest valid sizes
        backbone.preprocessor.target_size(policy, spec.size, spec.size)
    if spec.dtype not in DTYPES:
        raise InvalidOptionError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    return CatalogMeta(
        model=model,
        revision=backbone.checkpoint.revision,
        preprocess_hash=backbone.preprocess_config.hash(),
        pooling=pooling,
        layers=layers,
        size=None if spec.size is None else list(spec.size),
        policy=policy,
        normalized=spec.normalize,
        dim=backbone.output_dim(pooling, layers),
        dtype=spec.dtype,
    )


def read_job_file(folder: Path) -> tuple[CatalogMeta, dict[str, Any]] | None:
    path = folder / CATALOG_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path} is not valid JSON ({exc}); it was not written by embed-catalog") from exc
    return CatalogMeta.from_dict(raw), dict(raw.get("job") or {})


def stored_precision(folder: Path) -> str | None:
    """The precision an earlier run of this catalog resolved to (None: no earlier run)."""
    found = read_job_file(folder)
    return None if found is None else found[1].get("precision_used")


def _differences(
    meta: CatalogMeta, record: JobRecord, old_meta: CatalogMeta, old: dict[str, Any]
) -> list[str]:
    diffs = old_meta.embed_options_mismatch(meta)
    for name in ("model", "dtype"):
        if getattr(old_meta, name) != getattr(meta, name):
            diffs.append(f"{name}: {getattr(old_meta, name)} != {getattr(meta, name)}")
    for name in ("source", "source_kind", "extra_columns", "precision"):
        if old.get(name) != getattr(record, name):
            diffs.append(f"{name}: {old.get(name)} != {getattr(record, name)}")
    return diffs


def check_existing(folder: Path, meta: CatalogMeta, record: JobRecord) -> bool:
    """True when ``folder`` already holds this job; raises when it holds another one or something else."""
    found = read_job_file(folder)
    if found is None:
        if shard_paths(folder):
            raise CatalogError(
                f"{folder} holds Parquet shards but no {CATALOG_FILE}: it is not a catalog this version can "
                "resume; write to a new --out folder"
            )
        return False
    old_meta, old = found
    diffs = _differences(meta, record, old_meta, old)
    if diffs:
        raise CatalogError(
            f"{folder} holds a catalog made with other options ({'; '.join(diffs)}); rerun with the same "
            "arguments to resume it, or write to a new --out folder"
        )
    return True


def open_output(folder: Path, meta: CatalogMeta, record: JobRecord, source: Source) -> OutputState:
    """Create or resume ``folder``: pin the job in catalog.json, clean up, and collect the ids done."""
    folder.mkdir(parents=True, exist_ok=True)
    resumed = check_existing(folder, meta, record)
    if not resumed:
        _write_job_file(folder, meta, record)
    remove_partial_shards(folder)
    for path in shard_paths(folder):
        if read_shard_meta(path) != meta:
            raise CatalogError(f"{path} was written with other options than {folder / CATALOG_FILE}")
    rows = committed_ids(folder)
    failures = ErrorLog(folder).ids
    known = {item.id for item in source.items}
    strangers = [i for i in [*rows, *failures] if i not in known]
    if strangers:
        raise CatalogError(
            f"{folder} holds {len(strangers)} id(s) that are not in the source (e.g. {strangers[0]!r}): "
            "the source changed since the catalog was started; write to a new --out folder"
        )
    return OutputState(
        folder=folder,
        meta=meta,
        record=record,
        done=set(rows) | failures,
        rows_before=len(rows),
        failures_before=len(failures),
        next_shard=next_shard_index(folder),
        resumed=resumed,
    )


def _write_job_file(folder: Path, meta: CatalogMeta, record: JobRecord) -> None:
    path = folder / CATALOG_FILE
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps({**meta.to_dict(), "job": asdict(record)}, indent=2, sort_keys=True)
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
