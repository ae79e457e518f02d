"""``AsyncClient``: the same API as ``Client`` on asyncio (one ``httpx.AsyncClient``)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import httpx
import numpy as np

from . import protocol as p
from .client import DEFAULT_URL, batches, check_batching, http_options, known_length, progress_default
from .errors import ConnectError, TransportError, VitembedError, from_response
from .progress import Progress
from .retry import RetryPolicy, next_wait


class AsyncClient:
    """``AsyncClient(base_url, api_key=None, timeout=60.0)``; use ``async with`` or ``await aclose()``."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 60.0,
        *,
        retry: RetryPolicy | None = None,
        max_connections: int = 16,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.retry = retry if retry is not None else RetryPolicy()
        self._rng = random.Random()
        self._http = httpx.AsyncClient(**http_options(base_url, api_key, timeout, max_connections, transport))

    async def embed(self, images: p.ImageInput | Iterable[p.ImageInput], **options: Any) -> np.ndarray:
        """See ``Client.embed``."""
        call = p.embed_call(p.as_image_list(images), options)
        return p.read_npy(await self._send(call))

    async def embed_with_provenance(
        self, images: p.ImageInput | Iterable[p.ImageInput], **options: Any
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """See ``Client.embed_with_provenance``."""
        response = await self._send(p.embed_call(p.as_image_list(images), options))
        return p.read_npy(response), p.read_provenance(response)

    async def embed_many(
        self,
        images: Iterable[p.ImageInput],
        *,
        batch_size: int = 16,
        concurrency: int = 4,
        progress: bool | None = None,
        **options: Any,
    ) -> AsyncIterator[np.ndarray]:
        """See ``Client.embed_many``: ``async for vector in client.embed_many(paths)``."""
        check_batching(batch_size, concurrency)
        p.form_fields(options, p.EMBED_OPTIONS, "embed_many")
        bar = Progress(known_length(images), enabled=progress_default(progress))
        pending: deque[asyncio.Task[np.ndarray]] = deque()
        try:
            for batch in batches(images, batch_size):
                pending.append(asyncio.ensure_future(self.embed(batch, **options)))
                if len(pending) >= concurrency:
                    for row in await self._rows(pending.popleft(), bar):
                        yield row
            while pending:
                for row in await self._rows(pending.popleft(), bar):
                    yield row
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            bar.close()

    async def classify(self, images: p.ImageInput | Iterable[p.ImageInput], **options: Any) -> dict[str, Any]:
        """See ``Client.classify``."""
        response = await self._send(p.classify_call(p.as_image_list(images), options))
        body: dict[str, Any] = p.read_json(response)
        return body

    async def search(
        self,
        images: p.ImageInput | Iterable[p.ImageInput] | None = None,
        *,
        vector: Sequence[float] | np.ndarray | None = None,
        index: str | None = None,
        k: int = 10,
        where: str | None = None,
        nprobes: int | None = None,
    ) -> p.SearchResult:
        """See ``Client.search``."""
        listed = None if images is None else p.as_image_list(images)
        options = {"index": index, "k": k, "where": where, "nprobes": nprobes}
        return p.read_search(await self._send(p.search_call(listed, vector, options)))

    async def models(self) -> list[p.Model]:
        return p.read_models(await self._send(p.MODELS_CALL))

    async def _rows(self, task: asyncio.Task[np.ndarray], bar: Progress) -> np.ndarray:
        array = await task
        bar.update(len(array))
        return array

    async def _send(self, call: p.Call) -> httpx.Response:
        started = time.monotonic()
        kwargs = call.request_kwargs()
        for attempt in itertools.count():
            error: VitembedError
            try:
                response = await self._http.request(call.method, call.path, **kwargs)
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
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
