"""Vectors → response bodies: JSON numbers, base64 little-endian bytes, or one ``.npy`` array.

Finiteness is checked before anything is written (a NaN must never reach a client as a number, nor make
the JSON encoder fail halfway); float16 overflow is refused rather than sent as infinity.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pydantic_core

from vit_backbone.pooling import nonfinite_rows
from vitembed.engine.engine import EmbedOutcome
from vitembed.engine.served_heads import heads_json, heads_provenance, non_finite_head
from vitembed.metrics import Metrics
from vitembed.server.errors import ApiError

T = TypeVar("T")

NPY_MEDIA_TYPE = "application/x-npy"
HEADER_PREFIX = "X-Vitembed-"
_LITTLE_ENDIAN: dict[str, np.dtype[Any]] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
OFFLOAD_VALUES = 200_000  # above this many numbers, serialise in a thread: the event loop keeps serving


async def timed(metrics: Metrics, work: Callable[[], T], *, values: int, offload: bool = False) -> T:
    """Run one serialisation, off the event loop when it is large (or ``offload``), and record the
    ``serialise`` stage."""
    started = time.perf_counter()
    try:
        return await asyncio.to_thread(work) if offload or values > OFFLOAD_VALUES else work()
    finally:
        metrics.stage_seconds.labels("serialise").observe(time.perf_counter() - started)


def check_finite(vectors: np.ndarray) -> None:
    bad = nonfinite_rows(vectors)
    if len(bad):
        raise ApiError(
            500,
            "non_finite",
            "the model produced non-finite values (NaN or infinity) for this image",
            index=int(bad[0]),
        )


def cast(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """float32 [n, ...] → the requested little-endian dtype, refusing float16 overflow."""
    out = np.ascontiguousarray(vectors, dtype=_LITTLE_ENDIAN[dtype])
    if dtype == "float16":
        bad = nonfinite_rows(out)
        if len(bad):
            raise ApiError(
                422,
                "dtype_overflow",
                "the embedding has values beyond the float16 range (±65504); ask for dtype=float32",
                index=int(bad[0]),
            )
    return out


def b64(row: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(row).tobytes()).decode("ascii")


def dumps(payload: Any) -> bytes:
    """Compact JSON, ASCII-escaped, refusing non-finite floats like ``json.dumps(allow_nan=False)``.

    Written by pydantic-core's encoder: the default ``/v1/embed`` answer is hundreds of floats, and the
    standard library's float formatting took ~170 µs per 384-d embedding on the event loop (0.06 of a core
    at 65 images/s, CPU the forward passes then lack); pydantic-core takes ~20 µs for the same values. Its
    numbers parse to the same doubles (it writes ``0.00001`` where ``json`` writes ``1e-05``). The vectors
    are checked for non-finite values before they get here; should one still slip through, the encoder's
    ``NaN`` / ``Infinity`` constant sends the payload down the standard library's path, which raises."""
    out = pydantic_core.to_json(payload, ensure_ascii=True, inf_nan_mode="constants")
    if b"NaN" in out or b"Infinity" in out:  # a real non-finite value, or only a string containing one
        return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    return out


# the ``X-Vitembed-*`` headers of a ``.npy`` answer (``embed_npy``), as the OpenAPI document declares them:
# a string, or a value as compact JSON (lists, numbers, true/false, null)
NPY_HEADERS: dict[str, str] = {
    "Model": "the served model's name",
    "Revision": "the checkpoint's revision",
    "Preprocess-Hash": "the hash of the preprocessing configuration",
    "Pooling": "the pooling of the array: cls, mean, cls_mean, patch, ...",
    "Layers": "JSON: the blocks pooled, null for the last",
    "Normalized": "JSON: whether each vector was L2-normalised",
    "Dtype": "the array's element type",
    "Policy": "the resize policy",
    "Interpolation": "the position-embedding interpolation rule",
    "Precision": "the forward pass's precision",
    "Preset": "the size preset, or null",
    "Size": "JSON: [height, width] the images were resized to, or null",
    "Precision-Cosine": "JSON: the warm-up cosine of the reduced precision against float32, or null",
    "Dim": "the embedding width F (the array's last axis)",
    "Grids": "JSON: each image's patch grid [h, w]",
    "Valid": "JSON, only when some patches are padding: each image's mask as [row factors, column factors]",
}


def provenance(outcome: EmbedOutcome, dtype: str) -> dict[str, Any]:
    return {
        "model": outcome.model,
        "revision": outcome.revision,
        "preprocess_hash": outcome.preprocess_hash,
        "pooling": outcome.pooling,
        "layers": None if outcome.layers is None else list(outcome.layers),
        "normalized": outcome.normalized,
        "dtype": dtype,
        "policy": outcome.policy,
        "interpolation": outcome.interpolation,
        "precision": outcome.precision,
        "preset": outcome.preset,
        "size": None if outcome.size is None else list(outcome.size),
        "precision_cosine": outcome.precision_cosine,
    }


def embed_json(outcome: EmbedOutcome, *, dtype: str, encoding: str, return_grid: bool | None) -> bytes:
    """The ``/v1/embed`` JSON body; ``return_grid=None`` includes grids only for ``pooling=patch``."""
    check_finite(outcome.vectors)
    vectors = cast(outcome.vectors, dtype)  # [n, F] or [n, h, w, F]
    with_grid = outcome.pooling == "patch" if return_grid is None else return_grid
    data = []
    for index, row in enumerate(vectors):
        item: dict[str, Any] = {
            "index": index,
            "embedding": b64(row) if encoding == "base64" else row.tolist(),
        }
        if with_grid:
            item["grid"] = list(outcome.grids[index])
            if outcome.valid:  # [h][w] fraction of each patch that is image (pad's letterbox: 0)
                item["valid"] = np.round(outcome.valid[index], 6).tolist()
        if outcome.heads:  # computed from the same forward pass as the embedding
            bad = non_finite_head(outcome.heads, outcome.head_outputs[index])
            if bad is not None:
                raise ApiError(500, "non_finite", f"head {bad!r} produced non-finite values", index=index)
            valid = outcome.valid[index] if outcome.valid else None
            item["heads"] = heads_json(outcome.heads, outcome.head_outputs[index], valid)
        data.append(item)
    facts = provenance(outcome, dtype)
    if outcome.heads:
        facts["heads"] = heads_provenance(outcome.heads, outcome.precision)
    return dumps({"model": outcome.model, "dim": int(vectors.shape[-1]), "data": data, "provenance": facts})


def embed_npy(outcome: EmbedOutcome, *, dtype: str) -> tuple[bytes, dict[str, str]]:
    """One ``.npy`` array [n, F] or [n, h, w, F]; provenance goes in ``X-Vitembed-*`` headers."""
    check_finite(outcome.vectors)
    vectors = cast(outcome.vectors, dtype)
    buffer = io.BytesIO()
    np.save(buffer, vectors, allow_pickle=False)
    facts = provenance(outcome, dtype)
    headers = {
        f"{HEADER_PREFIX}{key.replace('_', '-').title()}": value
        if isinstance(value, str)
        else json.dumps(value, separators=(",", ":"))
        for key, value in facts.items()
    }
    headers[f"{HEADER_PREFIX}Dim"] = str(vectors.shape[-1])
    headers[f"{HEADER_PREFIX}Grids"] = json.dumps([list(g) for g in outcome.grids], separators=(",", ":"))
    if outcome.valid:
        headers[f"{HEADER_PREFIX}Valid"] = json.dumps(
            [valid_factors(m) for m in outcome.valid], separators=(",", ":")
        )
    return buffer.getvalue(), headers


def valid_factors(mask: np.ndarray) -> list[list[float]] | None:
    """A letterbox mask [h, w] as its row and column factors (``mask == outer(rows, cols)``: a ``pad``
    mask is the product of a row coverage and a column coverage), None when every patch is image. Small
    enough for a header at any grid, unlike the mask itself."""
    if bool((mask == 1).all()):
        return None
    i, j = np.unravel_index(int(np.argmax(mask)), mask.shape)
    rows = mask[:, j]  # [h]
    cols = mask[i, :] / mask[i, j]  # [w]
    return [np.round(rows, 6).tolist(), np.round(cols, 6).tolist()]


def openai_json(outcome: EmbedOutcome, *, encoding_format: str) -> bytes:
    """OpenAI's embeddings shape; ``base64`` is float32 little-endian, as the official client decodes it."""
    check_finite(outcome.vectors)
    vectors = cast(outcome.vectors.reshape(len(outcome.vectors), -1), "float32")  # [n, F]
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": b64(row) if encoding_format == "base64" else row.tolist(),
        }
        for index, row in enumerate(vectors)
    ]
    return dumps(
        {
            "object": "list",
            "data": data,
            "model": outcome.model,
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }
    )
