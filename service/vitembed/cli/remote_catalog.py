"""``embed-catalog --server URL``: the catalog job with a running ``vitembed serve`` doing the decoding and
the forward passes, through ``vitembed_client``; the folder it writes is the local engine's (same shards, same
catalog.json, same errors.jsonl, same resume rules), so either path can resume the other's catalog.

Data flow: source items not yet done → batches of ``batch_size`` → ``concurrency`` request threads (each
reads its batch's files and sends them in one ``POST /v1/embed``; several requests in flight let the
server's dynamic batcher fill its forward passes) → answers put back in source order → ``ShardWriter``
(the local engine's: committed every ``shard_size`` rows) and ``ErrorLog``.

What the server answers:

* an error about one image (it carries the image's ``index``: not an image, truncated, too many pixels,
  non-finite output) → that image's errors.jsonl line, with the server's code; the rest of the batch is
  sent again without it. An image error without an index, a body over the server's limit, or a 500 splits
  the batch in halves until the culprit is alone;
* 429 and 503 → retried by the client, honouring ``Retry-After``, for up to ``retry_for`` seconds;
* anything else (unreachable after the retries, a wrong key, the model gone, a connection cut) → the job
  stops: the rows answered so far (in source order) are committed, then one line says why. Rerunning the
  same command resumes.

The catalog's meta comes from the server: a probe request with the job's options answers with the resolved
pooling, layers, policy, preset, precision, revision and preprocessing, and ``/v1/models`` gives where the
weights were loaded from (``location``), so ``vitembed search`` can load them later. Every answer's
provenance is checked against it: a server restarted mid-job with other weights or another precision stops
the job rather than mixing vectors.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vit_backbone.catalog.decode_stage import INVALID_NAME, failure_for, read_file
from vit_backbone.catalog.error_log import ErrorLog, ItemFailure
from vit_backbone.catalog.job_folder import EmbedSpec, OutputState
from vit_backbone.catalog.local_engine import INTERNAL_ERROR, JobSummary, RunSettings, ShardWriter, summarize
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.catalog.sources import Source, SourceItem
from vit_backbone.decode import DecodeLimits
from vit_backbone.errors import InvalidOptionError, ModelNotFoundError
from vitembed.cli.remote import ServerError, describe

ProgressFn = Callable[[int, int], None]
# provenance that must stay the probe's for every answer (else the vectors are not comparable)
CHECKED = ("revision", "preprocess_hash", "pooling", "layers", "policy", "precision", "size")
# a lone image's error without an index (the body or the forward failed as a whole) -> its errors.jsonl code
LONE_CODES = {"body_too_large": "too_large", "internal": INTERNAL_ERROR}


@dataclass(frozen=True)
class RemoteOptions:
    url: str
    api_key: str | None
    model: str | None  # a served model's name; None: the server's default
    concurrency: int = 4  # requests in flight
    retry_for: float = 60.0  # seconds a request keeps retrying 429/503/refused connections


@dataclass(frozen=True)
class ServedJob:
    """What every request sends, and the catalog meta the server's answers make."""

    options: dict[str, Any]  # /v1/embed options
    meta: CatalogMeta
    precision: str  # the server's compute precision (float32 | bfloat16 | float16)


def retry_policy(remote: RemoteOptions) -> Any:
    from vitembed_client import RetryPolicy

    return RetryPolicy(max_attempts=1_000_000, deadline=remote.retry_for, max_backoff=5.0)


def probe_image() -> bytes:
    """A small PNG that any model decodes: the probe that makes the server resolve the job's options."""
    from PIL import Image

    ramp = np.linspace(0, 255, 96, dtype=np.uint8)  # [96]
    pixels = np.stack(np.broadcast_arrays(ramp[:, None], ramp[None, :], ramp[::-1, None]), -1)  # [96, 96, 3]
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="PNG")
    return buffer.getvalue()


def resolve_served(client: Any, remote: RemoteOptions, spec: EmbedSpec) -> ServedJob:
    """The served model and the meta its answers give for ``spec`` (refused in one line when it cannot)."""
    from vitembed_client import APIError

    models = client.models()
    served = ", ".join(m.id for m in models) or "none"
    chosen = [m for m in models if (m.id == remote.model if remote.model else m.default)] or models[:1]
    if not chosen or (remote.model and chosen[0].id != remote.model):
        raise ModelNotFoundError(
            f"the server at {remote.url} does not serve model {remote.model!r} (it serves: {served}); with "
            "--server, --model names a served model"
        )
    model = chosen[0]
    options: dict[str, Any] = {
        "model": model.id,
        "pooling": spec.pooling,
        "layers": None if spec.layers is None else list(spec.layers),
        "size": None if spec.size is None else list(spec.size),
        "policy": spec.policy,
        "preset": spec.preset,
        "normalize": spec.normalize,
        "dtype": "float32",  # stored as --dtype here, as the local engine stores its float32 vectors
    }
    options = {k: v for k, v in options.items() if v is not None}
    try:
        vectors, facts = client.embed_with_provenance([probe_image()], **options)  # [1, D]
    except APIError as exc:
        if exc.status in (400, 404, 422):  # the options (or the model) cannot be honoured there
            raise InvalidOptionError(
                f"the server at {remote.url} refused the job's options: {exc.message}"
            ) from exc
        raise
    precision = str(facts.get("precision") or model.info.get("precision") or "")
    if spec.precision not in ("auto", precision):
        raise InvalidOptionError(
            f"--precision {spec.precision}: the server at {remote.url} computes in {precision}; drop "
            f"--precision (auto records the server's) or start the server with --precision {spec.precision}"
        )
    if vectors.ndim != 2:
        raise InvalidOptionError(
            f"the server answers {list(vectors.shape)} per batch, not one vector per image"
        )
    layers = facts.get("layers")
    meta = CatalogMeta(
        model=model.id,
        revision=str(facts["revision"]),
        preprocess_hash=str(facts["preprocess_hash"]),
        pooling=str(facts["pooling"]),
        layers=None if layers is None else [int(i) for i in layers],
        size=_served_size(facts.get("size"), spec.size),
        policy=str(facts["policy"]),
        normalized=spec.normalize,
        dim=int(vectors.shape[1]),
        dtype=spec.dtype,
        precision=precision,
        preset=str(facts.get("preset") or "") or None,
        model_location=model.info.get("location"),
    )
    return ServedJob(options, meta, precision)


@dataclass
class _Answer:
    items: list[SourceItem]  # embedded, in source order
    vectors: np.ndarray  # [len(items), D]
    failures: list[ItemFailure]  # in source order
    handled: int


class _BatchSender:
    """One batch through the server: its files read, sent, and every image's error recorded alone."""

    def __init__(self, client: Any, job: ServedJob, max_bytes: int) -> None:
        self.client = client
        self.job = job
        self.max_bytes = max_bytes

    def __call__(self, items: list[SourceItem]) -> _Answer:
        failures: dict[int, ItemFailure] = {}
        payload: list[tuple[int, bytes]] = []
        for pos, item in enumerate(items):
            if item.invalid:
                failures[pos] = ItemFailure(
                    id=item.id, path=item.path, code=INVALID_NAME, message=item.invalid
                )
                continue
            try:
                payload.append((pos, read_file(item.path, self.max_bytes)))
            except Exception as exc:  # read_error, too_large: recorded like the local engine's
                failures[pos] = failure_for(item, exc)
        rows: dict[int, np.ndarray] = {}
        self._send(items, payload, rows, failures)
        kept = sorted(rows)
        vectors = np.stack([rows[k] for k in kept]) if kept else np.zeros((0, self.job.meta.dim), np.float32)
        return _Answer([items[k] for k in kept], vectors, [failures[k] for k in sorted(failures)], len(items))

    def _send(
        self,
        items: list[SourceItem],
        payload: list[tuple[int, bytes]],
        rows: dict[int, np.ndarray],
        failures: dict[int, ItemFailure],
    ) -> None:
        from vitembed_client import APIError, InvalidImageError

        parts = [payload]
        while parts:
            part = parts.pop()
            if not part:
                continue
            try:
                vectors, facts = self.client.embed_with_provenance(
                    [data for _, data in part], **self.job.options
                )
            except APIError as exc:
                lone = exc.code in LONE_CODES or isinstance(exc, InvalidImageError)
                if exc.index is not None and 0 <= exc.index < len(part):  # about that image alone
                    pos = part[exc.index][0]
                    failures[pos] = _failure(items[pos], exc.code, exc.message)
                    parts.append(part[: exc.index] + part[exc.index + 1 :])
                elif lone and len(part) > 1:
                    half = len(part) // 2
                    parts += [part[half:], part[:half]]
                elif lone:
                    pos = part[0][0]
                    failures[pos] = _failure(items[pos], LONE_CODES.get(exc.code, exc.code), exc.message)
                else:
                    raise
                continue
            check_provenance(self.job, facts)
            for (pos, _), row in zip(part, vectors, strict=True):
                rows[pos] = row  # [D]


def _failure(item: SourceItem, code: str, message: str) -> ItemFailure:
    return ItemFailure(id=item.id, path=item.path, code=code, message=" ".join(message.split()))


def check_provenance(job: ServedJob, facts: dict[str, Any]) -> None:
    expected = {**job.meta.to_dict(), "precision": job.precision}
    changed = [f"{k}: {expected[k]} -> {facts.get(k)}" for k in CHECKED if facts.get(k) != expected[k]]
    if changed:
        raise ServerError(
            f"the server's answers changed mid-job ({', '.join(changed)}): was it restarted with another "
            "model or options? Restart it as before"
        )


def run_remote(
    client: Any,
    job: ServedJob,
    source: Source,
    state: OutputState,
    settings: RunSettings,
    remote: RemoteOptions,
    *,
    stop: threading.Event | None = None,
    progress: ProgressFn | None = None,
) -> JobSummary:
    """Embed what ``state`` has not done through the server; committed like ``run_local``. Raises
    ``ServerError`` (after committing what was answered) when the server stops answering."""
    stop = stop or threading.Event()
    todo = [item for item in source.items if item.id not in state.done]
    batches = [todo[i : i + settings.batch_size] for i in range(0, len(todo), settings.batch_size)]
    errors = ErrorLog(state.folder)
    writer = ShardWriter(state, errors, settings.shard_size, source.extra_columns)
    pool = _RequestPool(_BatchSender(client, job, DecodeLimits().max_bytes), remote.concurrency)
    failures = 0
    error: BaseException | None = None
    started = time.perf_counter()
    ready: dict[int, _Answer] = {}
    next_write = 0
    try:
        submitted = 0
        while next_write < len(batches):
            while not stop.is_set() and submitted < len(batches) and pool.in_flight < 2 * remote.concurrency:
                pool.submit(submitted, batches[submitted])
                submitted += 1
            if stop.is_set():
                pool.cancel_queued()
            if pool.in_flight == 0:
                break  # stopped, and every answer already in
            seq, answer = pool.next_answer()
            if isinstance(answer, BaseException):
                error = answer
                break  # stop now: a request still retrying may take retry_for seconds more
            ready[seq] = answer
            while next_write in ready:
                done = ready.pop(next_write)
                for failure in done.failures:
                    errors.append(failure)
                failures += len(done.failures)
                if done.items:
                    writer.add(done.items, done.vectors)
                if progress is not None:
                    progress(done.handled, len(done.failures))
                next_write += 1
    finally:
        pool.close()
        writer.flush()
        errors.close()
    if error is not None:
        total = state.rows_before + writer.written
        raise ServerError(
            f"{_why(remote.url, error)}; stopped with {total} rows committed: run the same command again "
            "to resume"
        ) from error
    return summarize(
        source, todo, state, writer, failures, started=started, interrupted=next_write < len(batches)
    )


def _why(url: str, error: BaseException) -> str:
    from vitembed_client import VitembedError

    if isinstance(error, ServerError):
        return str(error)
    if isinstance(error, VitembedError):
        return describe(url, error)
    return f"a request to {url} failed: {type(error).__name__}: {error}"


class _RequestPool:
    """``concurrency`` daemon threads sending batches; answers (or the exception) come back tagged with the
    batch's number. Daemon threads: a request still retrying an unreachable server never holds up exit."""

    def __init__(self, send: Callable[[list[SourceItem]], _Answer], concurrency: int) -> None:
        self._tasks: queue.Queue[tuple[int, list[SourceItem]] | None] = queue.Queue()
        self._answers: queue.Queue[tuple[int, _Answer | BaseException]] = queue.Queue()
        self._send = send
        self.in_flight = 0
        self._threads = [
            threading.Thread(target=self._work, name=f"catalog-request-{k}", daemon=True)
            for k in range(concurrency)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            seq, items = task
            try:
                self._answers.put((seq, self._send(items)))
            except BaseException as exc:  # handed to the job's thread, which decides
                self._answers.put((seq, exc))

    def submit(self, seq: int, items: list[SourceItem]) -> None:
        self._tasks.put((seq, items))
        self.in_flight += 1

    def cancel_queued(self) -> None:
        """Take back the batches no thread has started (a stop was asked for)."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                return
            if task is not None:
                self.in_flight -= 1

    def next_answer(self) -> tuple[int, _Answer | BaseException]:
        answer = self._answers.get()
        self.in_flight -= 1
        return answer

    def close(self) -> None:
        self.cancel_queued()
        for _ in self._threads:
            self._tasks.put(None)


def _served_size(reported: Any, asked: Sequence[int] | None) -> list[int] | None:
    """The box the server prepared for (its provenance's ``size``: the preset's when none was asked for);
    a server from before it was reported: what was asked."""
    if isinstance(reported, list) and len(reported) == 2:
        return [int(reported[0]), int(reported[1])]
    return None if asked is None else list(asked)
