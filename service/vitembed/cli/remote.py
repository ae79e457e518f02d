"""``--server URL``: commands that embed use a running ``vitembed serve`` through ``vitembed_client`` instead
of loading the model in this process (seconds per call saved: the server keeps it loaded and warm).

The server must serve a model whose revision and preprocessing are the table's (search) or the head's
(heads predict): the same check as a local model, so vectors from the server and from the table compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.errors import ModelNotFoundError, VitEmbedError


def _client(url: str) -> Any:
    try:
        from vitembed_client import Client
    except ImportError as exc:
        raise VitEmbedError(
            "--server needs the client package: pip install ./client (from a clone of vitembed)",
            code="missing_extra",
        ) from exc
    return Client(url)


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


def query_vectors(url: str, meta: CatalogMeta, images: Sequence[bytes]) -> np.ndarray:
    """[Q, D] query vectors embedded by the server with the table's options."""
    with _client(url) as client:
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


def classify(url: str, head: str, images: Sequence[bytes], k: int) -> list[list[dict[str, Any]]]:
    """Each image's top-``k`` labels from the head ``head`` served at ``url``."""
    with _client(url) as client:
        body = client.classify(list(images), head=head, k=k)
    return [list(item["labels"]) for item in body["data"]]
