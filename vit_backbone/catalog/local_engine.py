"""The local engine of ``embed-catalog``: worker threads decode ahead, the calling thread runs the forward
passes and commits shards.

Data flow: source items not yet done → ``OrderedPrefetcher`` (read + decode + preprocess on ``workers``
threads, at most a few batches ahead) → batches of ``batch_size`` → ``Backbone.embed_prepared`` (the same
forward and pooling as the server) → ``ShardWriter`` (rows buffered, committed every ``shard_size`` rows as
one atomic Parquet file). Failed images go to errors.jsonl as they are met; a batch whose forward pass raises
is retried image by image and only the images that still fail are recorded (``internal_error``). When ``stop``
is set (Ctrl-C), the rows already embedded are committed and the job returns with ``interrupted=True``; a
later run with the same arguments continues from there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from vit_backbone.backbone import Backbone
from vit_backbone.catalog.decode_stage import failure_for, prepare_item
from vit_backbone.catalog.error_log import ErrorLog, ItemFailure
from vit_backbone.catalog.job_folder import OutputState
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.prefetch import OrderedPrefetcher, Stopped
from vit_backbone.catalog.shards import build_table, shard_name, write_shard
from vit_backbone.catalog.sources import Source, SourceItem
from vit_backbone.pooling import check_pooling
from vit_backbone.preprocess import Prepared

INTERNAL_ERROR = "internal_error"
ProgressFn = Callable[[int, int], None]  # (images handled since the last call, failures among them)


@dataclass(frozen=True)
class RunSettings:
    batch_size: int = 8  # the fastest model-only batch in bench/results/catalog.md
    workers: int = 2
    shard_size: int = 4096

    def __post_init__(self) -> None:
        for name in ("batch_size", "workers", "shard_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class JobSummary:
    rows_written: int  # this run
    failures: int  # this run
    skipped: int  # already done by an earlier run
    total_rows: int  # committed rows in the catalog after this run
    total_failures: int
    seconds: float  # from the first image to the last commit
    interrupted: bool
    shards_written: int

    @property
    def images_per_s(self) -> float:
        handled = self.rows_written + self.failures
        return handled / self.seconds if self.seconds > 0 else 0.0

    def line(self, errors_file: str | None = None) -> str:
        """One line for people; ``errors_file`` (the catalog's errors.jsonl) is named when it holds errors."""
        state = "interrupted" if self.interrupted else "done"
        handled = self.rows_written + self.failures
        speed = f"{self.images_per_s:.1f} images/s" if handled else "nothing left to embed"
        where = f" (see {errors_file})" if errors_file and self.total_failures else ""
        return (
            f"{state}: {self.rows_written} rows written, {self.failures} errors, "
            f"{self.skipped} already done; "
            f"catalog holds {self.total_rows} rows and {self.total_failures} errors{where}; {speed}"
        )


class ShardWriter:
    """Buffers embedded rows and commits them ``shard_size`` at a time, in source order."""

    def __init__(self, state: OutputState, errors: ErrorLog, shard_size: int, extra_columns: tuple[str, ...]):
        self.state = state
        self.errors = errors
        self.shard_size = shard_size
        self.extra_columns = extra_columns
        self.next_index = state.next_shard
        self.written = 0
        self.shards = 0
        self._items: list[SourceItem] = []
        self._vectors: list[np.ndarray] = []  # [b, D] blocks

    def add(self, items: list[SourceItem], vectors: np.ndarray) -> None:
        self._items.extend(items)
        self._vectors.append(vectors)
        while len(self._items) >= self.shard_size:
            self._commit(self.shard_size)

    def flush(self) -> None:
        if self._items:
            self._commit(len(self._items))
        self.errors.sync()

    def _commit(self, count: int) -> None:
        vectors = np.concatenate(self._vectors)  # [n, D]
        items, rest = self._items[:count], self._items[count:]
        extra = {name: [item.extra[k] for item in items] for k, name in enumerate(self.extra_columns)}
        table = build_table([item.id for item in items], vectors[:count], extra, self.state.meta)
        self.errors.sync()  # failures met before these rows are durable no later than the rows
        try:
            write_shard(self.state.folder, self.next_index, table)
        finally:
            # A second Ctrl-C (KeyboardInterrupt) may land anywhere: once the shard's file exists its rows
            # are committed, so they must leave the buffer, or the final flush would write them again.
            if (self.state.folder / shard_name(self.next_index)).exists():
                self.next_index += 1
                self.shards += 1
                self.written += count
                self._items = rest
                self._vectors = [vectors[count:]] if rest else []


def summarize(
    source: Source,
    todo: list[SourceItem],
    state: OutputState,
    writer: ShardWriter,
    failures: int,
    *,
    started: float,
    interrupted: bool,
) -> JobSummary:
    """One run's summary, the same for every engine: this run's counts next to the catalog's totals
    (``started`` is the run's ``time.perf_counter()`` at its first image)."""
    return JobSummary(
        rows_written=writer.written,
        failures=failures,
        skipped=len(source.items) - len(todo),
        total_rows=state.rows_before + writer.written,
        total_failures=state.failures_before + failures,
        seconds=time.perf_counter() - started,
        interrupted=interrupted,
        shards_written=writer.shards,
    )


def embed_batch(backbone: Backbone, meta: CatalogMeta, prepared: list[Prepared]) -> np.ndarray:
    """The server's forward path for one batch: ``[b, D]`` float32."""
    return backbone.embed_prepared(
        prepared,
        pooling=check_pooling(meta.pooling),
        layers=meta.layers,
        normalize=meta.normalized,
        batch_size=len(prepared),
    )


def embed_isolating(
    backbone: Backbone, meta: CatalogMeta, prepared: list[Prepared]
) -> tuple[np.ndarray, list[str]]:
    """``embed_batch``, but a batch whose forward raises is retried one image at a time, so one image that
    breaks the model (or runs it out of memory in a batch) fails alone. Returns ``[b, D]`` vectors (zeros
    where failed) and one message per row ("" = embedded), for an ``internal_error`` record."""
    try:
        return embed_batch(backbone, meta, prepared), [""] * len(prepared)
    except Exception as exc:
        if len(prepared) == 1:
            return np.zeros((1, meta.dim), dtype=np.float32), [_describe(exc)]
    vectors = np.zeros((len(prepared), meta.dim), dtype=np.float32)  # [b, D]
    messages = []
    for k, one in enumerate(prepared):
        try:
            vectors[k] = embed_batch(backbone, meta, [one])[0]  # [D]
            messages.append("")
        except Exception as exc:
            messages.append(_describe(exc))
    return vectors, messages


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"the forward pass failed: {type(exc).__name__}" + (f": {text}" if text else "")


def run_local(
    backbone: Backbone,
    source: Source,
    state: OutputState,
    settings: RunSettings,
    *,
    stop: threading.Event | None = None,
    progress: ProgressFn | None = None,
) -> JobSummary:
    stop = stop or threading.Event()
    meta = state.meta
    todo = [item for item in source.items if item.id not in state.done]
    errors = ErrorLog(state.folder)
    writer = ShardWriter(state, errors, settings.shard_size, source.extra_columns)
    policy = backbone.check_policy(meta.policy)
    size = None if meta.size is None else (meta.size[0], meta.size[1])
    preprocessor = backbone.preprocessor

    def prepare(item: SourceItem) -> Prepared:
        return prepare_item(item, preprocessor, policy, size)

    prefetcher = OrderedPrefetcher(
        prepare, todo, workers=settings.workers, depth=2 * settings.batch_size + settings.workers, stop=stop
    )
    failures = 0
    interrupted = False
    started = time.perf_counter()
    batch_items: list[SourceItem] = []
    batch: list[Prepared] = []

    def forward() -> None:
        nonlocal failures
        vectors, messages = embed_isolating(backbone, meta, batch)  # [b, D]
        kept = [k for k, message in enumerate(messages) if not message]
        for k, message in enumerate(messages):
            if message:
                item = batch_items[k]
                errors.append(ItemFailure(id=item.id, path=item.path, code=INTERNAL_ERROR, message=message))
        failures += len(batch) - len(kept)
        if kept:
            writer.add([batch_items[k] for k in kept], vectors[kept])
        if progress is not None:
            progress(len(batch), len(batch) - len(kept))
        batch_items.clear()
        batch.clear()

    try:
        for item, result in prefetcher:
            if isinstance(result, BaseException):
                errors.append(failure_for(item, result))
                failures += 1
                if progress is not None:
                    progress(1, 1)
                continue
            batch_items.append(item)
            batch.append(result)
            if len(batch) >= settings.batch_size:
                forward()
                if stop.is_set():
                    raise Stopped
        if batch:
            forward()
    except Stopped:
        interrupted = True
        if batch:  # decoded already: embedding them costs one forward, and saves redoing them
            forward()
    finally:
        writer.flush()
        errors.close()
    return summarize(source, todo, state, writer, failures, started=started, interrupted=interrupted)
