"""``Client``: the blocking client (one ``httpx.Client``, thread-safe; ``embed_many`` runs its batches on a
thread pool)."""

from __future__ import annotations

import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from . import protocol as p
from .errors import ConnectError, TransportError, VitembedError, from_response
from .progress import Progress
from .retry import RetryPolicy, next_wait

DEFAULT_URL = "http://127.0.0.1:8000"


def base_headers(api_key: str | None, timeout: float | httpx.Timeout) -> dict[str, str]:
    """Every request's headers: the bearer token, and ``X-Request-Timeout`` (the server drops work this
    client will not wait for, and refuses at once what it cannot finish in time)."""
    headers = {"User-Agent": p.USER_AGENT}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    seconds = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
    if seconds is not None:
        headers["X-Request-Timeout"] = f"{float(seconds):g}"
    return headers


def http_options(
    base_url: str,
    api_key: str | None,
    timeout: float | httpx.Timeout,
    max_connections: int,
    transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None,
) -> dict[str, Any]:
    """The keyword arguments of the ``httpx.Client`` (or ``httpx.AsyncClient``) under a client: one
    connection pool of ``max_connections``, every request's headers, no proxy from the environment."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return {
        "base_url": base_url,
        "timeout": timeout,
        "headers": base_headers(api_key, timeout),
        "limits": limits,
        "transport": transport,
        "trust_env": False,
    }


def check_batching(batch_size: int, concurrency: int) -> None:
    if batch_size < 1 or concurrency < 1:
        raise ValueError(f"batch_size and concurrency must be at least 1, got {batch_size} and {concurrency}")


def batches(images: Iterable[p.ImageInput], size: int) -> Iterator[list[p.ImageInput]]:
    iterator = iter(images)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def known_length(images: Iterable[Any]) -> int | None:
    try:
        return len(images)  # type: ignore[arg-type]
    except TypeError:
        return None


class Client:
    """``Client(base_url, api_key=None, timeout=60.0)``. ``timeout`` bounds each HTTP attempt; ``retry``
    (a ``RetryPolicy``) bounds the retries of 429/503 answers, by default within 60 s of the first attempt."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 60.0,
        *,
        retry: RetryPolicy | None = None,
        max_connections: int = 16,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retry = retry if retry is not None else RetryPolicy()
        self._rng = random.Random()
        self._http = httpx.Client(**http_options(base_url, api_key, timeout, max_connections, transport))

    # ---------------------------------------------------------------------------------------- the API
    def embed(self, images: p.ImageInput | Iterable[p.ImageInput], **options: Any) -> np.ndarray:
        """Embeddings of ``images`` in one request, as one array [n, F] (or [n, h, w, F] for
        ``pooling="patch"``); options as for ``POST /v1/embed`` (model, pooling, layers, size, policy,
        preset, normalize, dtype, return_grid)."""
        call = p.embed_call(p.as_image_list(images), options)
        return p.read_npy(self._send(call))

    def embed_with_provenance(
        self, images: p.ImageInput | Iterable[p.ImageInput], **options: Any
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """``embed``, and what made the vectors: the answer's provenance (model, revision,
        preprocess_hash, pooling, layers as resolved, policy, normalized, precision, preset, dim, ...)."""
        response = self._send(p.embed_call(p.as_image_list(images), options))
        return p.read_npy(response), p.read_provenance(response)

    def embed_many(
        self,
        images: Iterable[p.ImageInput],
        *,
        batch_size: int = 16,
        concurrency: int = 4,
        progress: bool | None = None,
        **options: Any,
    ) -> Iterator[np.ndarray]:
        """One embedding per image, in input order, as the answers arrive: ``batch_size`` images a
        request, ``concurrency`` requests at once; ``images`` is read lazily (at most ``concurrency``
        batches ahead). ``progress`` (default: when stderr is a terminal) draws a bar on stderr."""
        check_batching(batch_size, concurrency)
        p.form_fields(options, p.EMBED_OPTIONS, "embed_many")  # refuse a bad option before any request
        bar = Progress(known_length(images), enabled=progress_default(progress))
        pending: deque[Future[np.ndarray]] = deque()
        with ThreadPoolExecutor(concurrency, thread_name_prefix="vitembed-client") as pool:
            try:
                for batch in batches(images, batch_size):
                    pending.append(pool.submit(self.embed, batch, **options))
                    if len(pending) >= concurrency:
                        yield from self._rows(pending.popleft(), bar)
                while pending:
                    yield from self._rows(pending.popleft(), bar)
            finally:
                for future in pending:
                    future.cancel()
                bar.close()

    def classify(self, images: p.ImageInput | Iterable[p.ImageInput], **options: Any) -> dict[str, Any]:
        """``POST /v1/classify``: the served head's answer per image (options head, k, upsample,
        upsample_mode); the JSON body as a dict (``data`` holds one entry per image, in order)."""
        body: dict[str, Any] = p.read_json(self._send(p.classify_call(p.as_image_list(images), options)))
        return body

    def search(
        self,
        images: p.ImageInput | Iterable[p.ImageInput] | None = None,
        *,
        vector: Sequence[float] | np.ndarray | None = None,
        index: str | None = None,
        k: int = 10,
        where: str | None = None,
        nprobes: int | None = None,
    ) -> p.SearchResult:
        """Top-``k`` similar items of a served index for query images or one query vector."""
        listed = None if images is None else p.as_image_list(images)
        options = {"index": index, "k": k, "where": where, "nprobes": nprobes}
        return p.read_search(self._send(p.search_call(listed, vector, options)))

    def models(self) -> list[p.Model]:
        return p.read_models(self._send(p.MODELS_CALL))

    # ---------------------------------------------------------------------------------------- plumbing
    def _rows(self, future: Future[np.ndarray], bar: Progress) -> Iterator[np.ndarray]:
        array = future.result()
        bar.update(len(array))
        yield from array

    def _send(self, call: p.Call) -> httpx.Response:
        started = time.monotonic()
        kwargs = call.request_kwargs()
        for attempt in itertools.count():
            error: VitembedError
            try:
                response = self._http.request(call.method, call.path, **kwargs)
            except httpx.ConnectError as exc:
                error = ConnectError(f"cannot connect to {self._http.base_url}: {exc}")
            except httpx.HTTPError as exc:
                raise TransportError(f"{call.method} {call.path}: {type(exc).__name__}: {exc}") from exc
            else:
                if response.status_code < 400:
                    return response
                error = from_response(response, attempts=attempt + 1)
            wait = next_wait(self.retry, error, attempt, started, self._rng)
            if wait is None:
                raise error
            time.sleep(wait)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_default(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress
