"""``--server URL``: commands that embed use a running ``vitembed serve`` through ``vitembed_client`` instead
of loading the model in this process (seconds per call saved: the server keeps it loaded and warm).

The server must serve a model whose revision and preprocessing are the table's (search) or the head's
(heads predict): the same check as a local model, so vectors from the server and from the table compare.
``embed-catalog --server`` is ``remote_catalog.py``. The client's errors (a refused connection, an error
answer) leave here as the library's ``VitEmbedError``, so the command prints them in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.errors import ModelNotFoundError, VitEmbedError


class ServerError(VitEmbedError):
    """The server could not be used: unreachable, or it refused the request as a whole."""

    code = "server_error"


def make_client(url: str, api_key: str | None = None, retry: Any = None) -> Any:
    """A ``vitembed_client.Client`` for ``url`` (``retry``: a ``RetryPolicy``, default the client's)."""
    try:
        from vitembed_client import Client
    except ImportError as exc:
        raise VitEmbedError(
            "--server needs the client package: pip install ./client (from a clone of vitembed)",
            code="missing_extra",
        ) from exc
    return Client(url, api_key=api_key, retry=retry)


def describe(url: str, exc: BaseException) -> str:
    """One line for a client error: what the server said (status, code, message) or why it did not answer."""
    from vitembed_client import APIError, AuthenticationError, ConnectError

    if isinstance(exc, AuthenticationError):
        return (
            f"the server at {url} refused the API key ({exc.message}); give --api-key or set VITEMBED_API_KEY"
        )
    if isinstance(exc, APIError):
        return f"the server at {url} answered {exc.status} {exc.code}: {exc.message}"
    if isinstance(exc, ConnectError):
        return f"cannot reach the server at {url} ({exc}); is `vitembed serve` running there?"
    return f"the server at {url} stopped answering ({exc})"


@contextlib.contextmanager
def connect(url: str, api_key: str | None = None, retry: Any = None) -> Iterator[Any]:
    """A client whose errors leave as ``ServerError`` (one line, the server's own words)."""
    from vitembed_client import VitembedError

    client = make_client(url, api_key, retry)
    try:
        yield client
    except VitembedError as exc:
        raise ServerError(describe(url, exc)) from exc
    finally:
        client.close()


def served_model(client: Any, url: str, revision: str, preprocess_hash: str, what: str) -> str:
    """The name of the served model whose vectors are in ``what``'s space."""
    models = client.models()
    for model in models:
        if (model.info.get("revision"), model.info.get("preprocess_hash")) == (revision, preprocess_hash):
            return str(model.id)
    served = ", ".join(f"{m.id} ({m.info.get('revision')})" for m in models) or "none"
    raise ModelNotFoundError(
        f"the server at {url} serves no model with {what}'s revision {revision} and preprocessing "
        f"{preprocess_hash} (it serves: {served}); start it with --model for that checkpoint"
    )


def query_vectors(
    url: str, meta: CatalogMeta, images: Sequence[bytes], *, api_key: str | None = None
) -> np.ndarray:
    """[Q, D] query vectors embedded by the server with the table's options."""
    with connect(url, api_key) as client:
        model = served_model(client, url, meta.revision, meta.preprocess_hash, "the table")
        vectors = client.embed(
            list(images),
            model=model,
            pooling=meta.pooling,
            layers=meta.layers,
            size=None if meta.size is None else tuple(meta.size),
            policy=meta.policy,
            normalize=meta.normalized,
        )
    return np.asarray(vectors, dtype=np.float32)  # [Q, D]


def classify(
    url: str, head: str, images: Sequence[bytes], k: int, *, api_key: str | None = None
) -> list[list[dict[str, Any]]]:
    """Each image's top-``k`` labels from the head ``head`` served at ``url``."""
    with connect(url, api_key) as client:
        body = client.classify(list(images), head=head, k=k)
    return [list(item["labels"]) for item in body["data"]]
