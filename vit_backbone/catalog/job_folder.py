"""Opening a catalog folder for a job: the options it was started with, and what is already done.

``catalog.json`` is written when a job first starts in a folder and pins everything that decides the
vectors (``CatalogMeta``) plus the job's source and precision. A rerun with the same arguments resumes —
committed shard rows and recorded failures are skipped, temporary files of an interrupted shard write are
deleted — and a rerun with different ones is refused, naming each difference, because one folder must
never mix vectors that are not comparable.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vit_backbone.backbone import Backbone
from vit_backbone.catalog.error_log import ErrorLog, drop_failures
from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.meta import DTYPES, CatalogMeta
from vit_backbone.catalog.shards import (
    committed_ids,
    fsync_dir,
    next_shard_index,
    read_shard_meta,
    remove_partial_shards,
    shard_paths,
)
from vit_backbone.catalog.sources import Source
from vit_backbone.errors import InvalidOptionError
from vit_backbone.pooling import check_pooling

CATALOG_FILE = "catalog.json"
LOCK_FILE = ".lock"


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
    preset: str | None = None  # named defaults for the options not given (None: the backbone's)


@dataclass(frozen=True)
class JobRecord:
    """What ``catalog.json`` holds besides the meta: enough to recognise "the same job" on a rerun."""

    source: str
    source_kind: str
    extra_columns: tuple[str, ...]
    precision: str  # as asked: auto | float32 | bfloat16 | float16
    precision_used: str  # what it resolved to on the first run; reused when resuming ("" = not yet)
    items: int  # items in the source when the job first started (for information)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "extra_columns": list(self.extra_columns)}

    @classmethod
    def from_dict(cls, raw: Any) -> JobRecord:
        """Tolerant of missing keys (an older or hand-edited catalog.json): they read as empty."""
        raw = raw if isinstance(raw, dict) else {}
        return cls(
            source=str(raw.get("source") or ""),
            source_kind=str(raw.get("source_kind") or ""),
            extra_columns=tuple(str(c) for c in raw.get("extra_columns") or ()),
            precision=str(raw.get("precision") or ""),
            precision_used=str(raw.get("precision_used") or ""),
            items=int(raw.get("items") or 0),
        )


@dataclass(frozen=True)
class JobFile:
    """``catalog.json`` as read back."""

    meta: CatalogMeta
    record: JobRecord


@dataclass(frozen=True)
class OutputState:
    folder: Path
    meta: CatalogMeta
    record: JobRecord
    done: frozenset[str] = frozenset()  # ids in committed shards or errors.jsonl
    rows_before: int = 0  # rows already committed when this run started
    failures_before: int = 0
    next_shard: int = 0
    resumed: bool = False
    retried: int = 0  # failures removed from errors.jsonl by --retry-errors, tried again now


class OutputLock:
    """An exclusive ``flock`` on ``DIR/.lock`` held for the whole job, so two jobs never write into one
    catalog folder (their shard numbers and errors.jsonl lines would collide). The kernel drops the lock
    when the process ends, however it ends, so a killed job never leaves a stale lock behind."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise CatalogError(
                f"another embed-catalog job is writing to {self.path.parent} (it holds {self.path}); "
                "wait for it to finish, or write to another --out folder"
            ) from None
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def resolve_meta(backbone: Backbone, model: str, spec: EmbedSpec) -> CatalogMeta:
    """Apply the model's defaults and validate every option before any image is read."""
    defaults = backbone.preset_defaults(spec.preset)
    pooling = check_pooling(spec.pooling or defaults.pooling)
    if pooling == "patch":
        raise InvalidOptionError(
            "pooling='patch' gives a grid per image, not one vector; a catalog stores one vector per image "
            "(use mean, gem, cls or cls_mean)"
        )
    requested = list(spec.layers) if spec.layers is not None else defaults.layers
    layers = backbone.resolve_layers(requested)
    policy = backbone.check_policy(spec.policy, spec.preset)
    size = backbone.choose_size(spec.size, spec.preset)  # stored resolved: the preset's box when not given
    if size is not None:  # a size no image can satisfy is refused now, with the nearest valid sizes
        backbone.preprocessor.target_size(policy, size, size)
    if spec.dtype not in DTYPES:
        raise InvalidOptionError(f"dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    return CatalogMeta(
        model=model,
        revision=backbone.checkpoint.revision,
        preprocess_hash=backbone.preprocess_config.hash(),
        pooling=pooling,
        layers=layers,
        size=None if size is None else list(size),
        policy=policy,
        normalized=spec.normalize,
        dim=backbone.output_dim(pooling, layers),
        dtype=spec.dtype,
        preset=defaults.preset,
        model_location=backbone.checkpoint.location,
    )


def read_job_file(folder: Path) -> JobFile | None:
    path = folder / CATALOG_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CatalogError(f"{path} is not valid JSON ({exc}); it was not written by embed-catalog") from exc
    return JobFile(meta=CatalogMeta.from_dict(raw), record=JobRecord.from_dict(raw.get("job")))


def _differences(meta: CatalogMeta, record: JobRecord, old: JobFile) -> list[str]:
    diffs = old.meta.embed_options_mismatch(meta)
    for name in ("model", "dtype"):
        if getattr(old.meta, name) != getattr(meta, name):
            diffs.append(f"{name}: {getattr(old.meta, name)} != {getattr(meta, name)}")
    for name in ("source", "source_kind", "extra_columns", "precision"):
        mine, theirs = getattr(old.record, name), getattr(record, name)
        if mine != theirs:
            show = (list(mine), list(theirs)) if name == "extra_columns" else (mine, theirs)
            diffs.append(f"{name}: {show[0]} != {show[1]}")
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
    diffs = _differences(meta, record, found)
    if diffs:
        raise CatalogError(
            f"{folder} holds a catalog made with other options ({'; '.join(diffs)}); rerun with the same "
            "arguments to resume it, or write to a new --out folder"
        )
    return True


def open_output(
    folder: Path,
    meta: CatalogMeta,
    record: JobRecord,
    source: Source,
    *,
    retry: tuple[str, ...] | None = None,
) -> OutputState:
    """Create or resume ``folder`` (hold its ``OutputLock``): pin the job in catalog.json, clean up, and
    collect the ids done. ``retry`` (``--retry-errors``) first drops those failure codes from errors.jsonl
    (``()``: every failure), so their ids are tried again."""
    folder.mkdir(parents=True, exist_ok=True)
    resumed = check_existing(folder, meta, record)
    if not resumed:
        _write_job_file(folder, meta, record)
    remove_partial_shards(folder)
    retried = 0 if retry is None else len(drop_failures(folder, frozenset(retry) or None))
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
        done=frozenset(rows) | frozenset(failures),
        rows_before=len(rows),
        failures_before=len(failures),
        next_shard=next_shard_index(folder),
        resumed=resumed,
        retried=retried,
    )


def _write_job_file(folder: Path, meta: CatalogMeta, record: JobRecord) -> None:
    path = folder / CATALOG_FILE
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps({**meta.to_dict(), "job": record.to_dict()}, indent=2, sort_keys=True)
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
