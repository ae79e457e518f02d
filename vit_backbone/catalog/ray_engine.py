"""The Ray Data engine of ``embed-catalog``: the same job spread over a Ray cluster.

Pipeline: the items still to do → ``ray.data.from_items`` → a CPU ``map_batches`` stage that reads, decodes
(JPEG draft, like the server) and preprocesses, recording each item's failure instead of raising → an actor
pool of embedders (``map_batches(Embedder, compute=ActorPoolStrategy(size=n))``, one GPU per actor when the
cluster has GPUs) that load the model once and run the server's forward path → the driver, which writes the
shards in exactly the local engine's layout (FixedSizeList column, metadata, atomic renames, errors.jsonl), so
resume, ``read_catalog`` and the index work the same whichever engine ran.

The driver streams results (order preserved) and commits every ``shard_size`` rows; a Ctrl-C stops after
committing what arrived. ``--precision auto`` is decided by one task on a worker with an embedder's resources
(``decide_precision``: the driver's hardware may not be the workers'), recorded, and applied by every actor
as an explicit one is. ``--workers`` caps the concurrent decode tasks.
The driver's ``DataContext`` is restored when the job ends. Pixels travel between the stages as raw float32
bytes with their shape, so the embedder sees bit-identical tensors to the local engine's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from vit_backbone.backbone import Backbone
from vit_backbone.catalog.decode_stage import failure_for, prepare_item
from vit_backbone.catalog.error_log import ErrorLog, ItemFailure
from vit_backbone.catalog.errors import CatalogError
from vit_backbone.catalog.job_folder import OutputState
from vit_backbone.catalog.local_engine import (
    INTERNAL_ERROR,
    JobSummary,
    ProgressFn,
    RunSettings,
    ShardWriter,
    embed_isolating,
    summarize,
)
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.sources import Source, SourceItem
from vit_backbone.errors import MissingExtraError, VitEmbedError
from vit_backbone.preprocess import Prepared, PreprocessConfig, Preprocessor
from vit_backbone.preprocess_config import literal_size


def require_ray() -> None:
    """Import Ray Data or say which extra to install."""
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise MissingExtraError("embed-catalog --engine ray", "ray") from exc
    del ray


@dataclass(frozen=True)
class RayOptions:
    address: str | None  # None: start a local cluster (unless one is already initialised in this process)
    actors: int | None  # None: one per GPU in the cluster, or 1 without GPUs
    model: str  # what each actor loads (an absolute path or id the workers can resolve, or "embedded")
    precision: str  # float32 | bfloat16 | float16 (auto is decided on a worker first: decide_precision)
    device: str = "auto"
    decode_tasks: int | None = None  # concurrent decode tasks (--workers); None: Ray Data decides


class DecodeStage:
    """CPU stage: ``{"row", "id", "path"}`` batches → pixels as bytes + shape, or the failure's code."""

    def __init__(
        self, config: PreprocessConfig, patch: tuple[int, int], grid: tuple[int, int], meta: CatalogMeta
    ):
        self.preprocessor = Preprocessor(config, patch, grid)
        self.policy: Any = meta.policy
        self.size = None if meta.size is None else (meta.size[0], meta.size[1])

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in ("row", "id", "pixels", "shape", "code", "message")}
        columns = (batch["row"], batch["id"], batch["path"], batch["invalid"])
        for row, item_id, path, invalid in zip(*columns, strict=True):
            item = SourceItem(id=str(item_id), path=str(path), invalid=str(invalid))
            pixels, shape, code, message = b"", [0, 0, 0, 0, 0], "", ""
            try:
                prepared = prepare_item(item, self.preprocessor, self.policy, self.size)
                array = prepared.pixel_values.numpy()  # [3, H, W] float32
                pixels = array.tobytes()
                shape = [*array.shape, *prepared.grid]
            except Exception as exc:
                failure = failure_for(item, exc)
                code, message = failure.code, failure.message
            for key, value in zip(out, (int(row), item.id, pixels, shape, code, message), strict=True):
                out[key].append(value)
        return out


class Embedder:
    """Actor stage: loads the model once, embeds the decoded rows, passes failures through. A forward pass
    that raises is retried image by image and the images that still fail come back as ``internal_error``
    rows: the actor never raises for an image, so one bad image cannot fail the whole Ray job."""

    def __init__(self, model: str, precision: str, meta: CatalogMeta, device: str) -> None:
        import torch

        from vit_backbone.catalog.precision import apply_precision
        from vit_backbone.loading import load_backbone
        from vit_backbone.precision import pick_device

        chosen = pick_device(device)
        self.backbone = load_backbone(model, device=chosen)
        if self.backbone.checkpoint.revision != meta.revision:
            raise CatalogError(
                f"the Ray workers resolve {model!r} to revision {self.backbone.checkpoint.revision}, "
                f"the driver to {meta.revision}: give every node the same checkpoint"
            )
        apply_precision(self.backbone, precision)
        self.meta = meta
        self._torch = torch

    def __call__(self, batch: dict[str, np.ndarray]) -> Any:
        import pyarrow as pa

        codes = [str(c) for c in batch["code"]]
        messages = [str(m) for m in batch["message"]]
        ok = [k for k, code in enumerate(codes) if not code]
        dim = self.meta.dim
        vectors = np.zeros((len(batch["row"]), dim), dtype=np.float32)  # [b, D]; zeros for failed rows
        if ok:
            prepared = []
            for k in ok:
                c, h, w, gh, gw = (int(v) for v in batch["shape"][k])
                pixels = np.frombuffer(batch["pixels"][k], dtype=np.float32).reshape(c, h, w)  # [3, H, W]
                tensor = self._torch.from_numpy(pixels.copy())
                prepared.append(Prepared(pixel_values=tensor, grid=(gh, gw), source_size=(h, w), policy=""))
            embedded, errors = embed_isolating(self.backbone, self.meta, prepared)  # [n_ok, D]
            vectors[ok] = embedded
            for k, error in zip(ok, errors, strict=True):
                if error:
                    codes[k], messages[k] = INTERNAL_ERROR, error
        flat = pa.array(vectors.reshape(-1))
        return pa.table(
            {
                "row": pa.array(batch["row"], type=pa.int64()),
                "id": pa.array([str(i) for i in batch["id"]], type=pa.string()),
                "embedding": pa.FixedSizeListArray.from_arrays(flat, dim),
                "code": pa.array(codes, type=pa.string()),
                "message": pa.array(messages, type=pa.string()),
            }
        )


def _one_line_error(exc: BaseException) -> VitEmbedError | None:
    """The vitembed error inside a Ray failure (Ray wraps it with remote tracebacks), re-raised as the
    one-line error the command prints; None when the failure is not one of ours."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for candidate in (getattr(current, "cause", None), current):
            if isinstance(candidate, VitEmbedError):
                message = str(candidate.args[0]) if candidate.args else str(candidate)
                first = message.strip().splitlines()[0] if message.strip() else type(candidate).__name__
                return CatalogError(first)
        current = current.__cause__ or current.__context__ or getattr(current, "cause", None)
    return None


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Join ``address`` (or start a local cluster) unless Ray is already initialised in this process; shut
    down on exit only what was started here. ``run_ray`` inside it reuses the session."""
    require_ray()
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started_here:
            ray.shutdown()


def decide_precision(model: str, meta: CatalogMeta, size: tuple[int, int] | None, batch_size: int) -> str:
    """``--precision auto`` on the hardware that runs the model: one Ray task with an embedder actor's
    resources (a GPU when the cluster has them) loads the model and applies the shared rule with the job's
    options; its answer is recorded in the catalog and every actor applies it."""
    import ray

    gpus = _cluster_gpus()
    probe = ray.remote(num_gpus=1 if gpus else 0)(_probe_precision)
    try:
        label: str = ray.get(probe.remote(model, meta, "auto" if gpus else "cpu", size, batch_size))
    except Exception as exc:
        ours = _one_line_error(exc)
        if ours is None:
            raise
        raise ours from None
    return label


def _probe_precision(
    model: str, meta: CatalogMeta, device: str, size: tuple[int, int] | None, batch: int
) -> str:
    from vit_backbone.catalog.precision import choose_precision
    from vit_backbone.loading import load_backbone
    from vit_backbone.precision import pick_device

    backbone = load_backbone(model, device=pick_device(device))
    options = {
        "pooling": meta.pooling,
        "layers": meta.layers,
        "size": literal_size(size),
        "policy": meta.policy,
    }
    return choose_precision(backbone, "auto", batch_size=batch, **options).label


def _cluster_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def run_ray(
    backbone: Backbone,
    source: Source,
    state: OutputState,
    settings: RunSettings,
    options: RayOptions,
    *,
    stop: threading.Event | None = None,
    progress: ProgressFn | None = None,
) -> JobSummary:
    require_ray()
    import ray
    import ray.data

    stop = stop or threading.Event()
    todo = [item for item in source.items if item.id not in state.done]
    started_here = not ray.is_initialized()
    if started_here:
        # a cluster started here gets no dashboard (an HTTP port); an existing one is joined as it is
        if options.address:
            ray.init(address=options.address, log_to_driver=False)
        else:
            ray.init(include_dashboard=False, log_to_driver=False)
    errors = ErrorLog(state.folder)
    writer = ShardWriter(state, errors, settings.shard_size, source.extra_columns)
    failures = 0
    interrupted = False
    started = time.perf_counter()
    context = ray.data.DataContext.get_current()
    preserve_order = context.execution_options.preserve_order
    try:
        if todo:
            gpus = _cluster_gpus()
            if options.precision == "float16" and not gpus:
                raise CatalogError("--precision float16 needs GPUs, and this Ray cluster has none")
            actors = options.actors or max(1, gpus)
            context.execution_options.preserve_order = True  # shards in source order, as the local engine
            rows = [
                {"row": n, "id": item.id, "path": item.path, "invalid": item.invalid}
                for n, item in enumerate(todo)
            ]
            decode = DecodeStage(
                backbone.preprocess_config, backbone.patch_size, backbone.processing_grid, state.meta
            )
            dataset = (
                ray.data.from_items(rows)
                .map_batches(
                    decode,
                    batch_size=settings.batch_size,
                    batch_format="numpy",
                    compute=ray.data.TaskPoolStrategy(size=options.decode_tasks),
                )
                .map_batches(
                    Embedder,
                    fn_constructor_kwargs={
                        "model": options.model,
                        "precision": options.precision,
                        "meta": state.meta,
                        "device": options.device if gpus else "cpu",
                    },
                    compute=ray.data.ActorPoolStrategy(size=actors),
                    num_gpus=1 if gpus else 0,
                    batch_size=settings.batch_size,
                    batch_format="numpy",
                )
            )
            try:
                for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
                    failures += _take(batch, todo, writer, errors, state.meta.dim, progress)
                    if stop.is_set():
                        interrupted = True
                        break
            except Exception as exc:
                ours = _one_line_error(exc)
                if ours is None:
                    raise
                raise ours from None
    finally:
        context.execution_options.preserve_order = preserve_order
        writer.flush()
        errors.close()
        if started_here:
            ray.shutdown()
    return summarize(source, todo, state, writer, failures, started=started, interrupted=interrupted)


def _take(
    batch: Any,
    todo: list[SourceItem],
    writer: ShardWriter,
    errors: ErrorLog,
    dim: int,
    progress: ProgressFn | None,
) -> int:
    """Record one result batch on the driver: failures to errors.jsonl, rows to the shard writer."""
    rows = batch.column("row").to_pylist()
    codes = batch.column("code").to_pylist()
    messages = batch.column("message").to_pylist()
    vectors = batch.column("embedding").combine_chunks().flatten().to_numpy().reshape(-1, dim)  # [b, D]
    kept: list[SourceItem] = []
    keep_rows: list[int] = []
    failed = 0
    for k, (row, code, message) in enumerate(zip(rows, codes, messages, strict=True)):
        item = todo[row]
        if code:
            errors.append(ItemFailure(id=item.id, path=item.path, code=code, message=message))
            failed += 1
        else:
            kept.append(item)
            keep_rows.append(k)
    if kept:
        writer.add(kept, vectors[keep_rows])
    if progress is not None:
        progress(len(rows), failed)
    return failed
