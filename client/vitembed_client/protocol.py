"""The API without I/O: what each call sends (``Call``) and how each answer is read. ``Client`` and
``AsyncClient`` only send calls and sleep between retries."""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import httpx
import numpy as np

from .errors import ResponseFormatError

NPY_MEDIA_TYPE = "application/x-npy"
USER_AGENT = "vitembed-client/0.1.0"
# /v1/embed options sent as form fields (embed returns one .npy array, so no encoding or heads here)
EMBED_OPTIONS = (
    "model",
    "pooling",
    "layers",
    "size",
    "policy",
    "preset",
    "normalize",
    "dtype",
    "return_grid",
)
CLASSIFY_OPTIONS = ("head", "k", "top_k", "upsample", "upsample_mode")  # top_k: alias of k
PROVENANCE_PREFIX = "x-vitembed-"
# provenance headers whose values are JSON (the others are plain strings, sent as they are)
_JSON_PROVENANCE = frozenset({"layers", "normalized", "precision_cosine", "dim", "grids", "valid", "size"})

# a path (str or PathLike), encoded image bytes, or a PIL image (sent losslessly as PNG)
ImageInput = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, Any]


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    files: list[tuple[str, tuple[str, bytes, str]]] | None = None
    data: dict[str, str] | None = None
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    def request_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"headers": {"X-Request-ID": uuid.uuid4().hex, **self.headers}}
        if self.files is not None:
            kwargs["files"] = self.files
            kwargs["data"] = self.data or {}
        elif self.json is not None:
            kwargs["json"] = self.json
        return kwargs


@dataclass(frozen=True)
class Model:
    id: str
    default: bool
    info: dict[str, Any]  # the model's Backbone.info(): family, dim, patch size, preprocessing, precision...


@dataclass(frozen=True)
class Hit:
    id: str
    score: float  # similarity under the index's metric: higher is more similar
    metadata: dict[str, Any]


@dataclass(frozen=True)
class SearchResult:
    index: str
    k: int
    hits: list[list[Hit]]  # one list per query, best first
    provenance: dict[str, Any]


# ------------------------------------------------------------------------------------------- inputs
def _is_pil(image: Any) -> bool:
    module = sys.modules.get("PIL.Image")  # never imported here: a PIL image implies PIL is loaded
    return module is not None and isinstance(image, module.Image)


def is_single_image(value: Any) -> bool:
    return isinstance(value, str | os.PathLike | bytes | bytearray | memoryview) or _is_pil(value)


def image_bytes(image: ImageInput) -> bytes:
    """The bytes to send for one image: a file's contents, the bytes given, or a PIL image as PNG."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        return Path(image).read_bytes()
    if _is_pil(image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(
        f"an image must be a path, encoded image bytes or a PIL image, not {type(image).__name__}"
    )


def as_image_list(images: ImageInput | Iterable[ImageInput]) -> list[ImageInput]:
    if is_single_image(images):
        return [images]
    if isinstance(images, Iterable):
        listed = list(images)
        if not listed:
            raise ValueError("no images given")
        return listed
    raise TypeError(f"images must be an image or an iterable of images, not {type(images).__name__}")


def form_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def form_fields(options: Mapping[str, Any], allowed: Sequence[str], what: str) -> dict[str, str]:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"{what}: unknown option {unknown[0]!r}; options: {', '.join(allowed)}")
    return {name: form_value(value) for name, value in options.items() if value is not None}


def _parts(images: Sequence[ImageInput]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [
        ("image", (f"image{i}", image_bytes(img), "application/octet-stream")) for i, img in enumerate(images)
    ]


# ------------------------------------------------------------------------------------------- calls
def embed_call(images: Sequence[ImageInput], options: Mapping[str, Any]) -> Call:
    if "heads" in options or "encoding" in options:
        raise TypeError(
            "embed returns one .npy array: heads and encoding are not options here (see classify)"
        )
    fields = form_fields(options, EMBED_OPTIONS, "embed")
    return Call("POST", "/v1/embed", files=_parts(images), data=fields, headers={"Accept": NPY_MEDIA_TYPE})


def classify_call(images: Sequence[ImageInput], options: Mapping[str, Any]) -> Call:
    fields = form_fields(options, CLASSIFY_OPTIONS, "classify")
    return Call(
        "POST", "/v1/classify", files=_parts(images), data=fields, headers={"Accept": "application/json"}
    )


def search_call(
    images: Sequence[ImageInput] | None,
    vector: Sequence[float] | np.ndarray | None,
    options: Mapping[str, Any],
) -> Call:
    if (images is None) == (vector is None):
        raise ValueError("search needs either images or vector (one of them)")
    body: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if images is not None:
        body["images"] = [{"base64": base64.b64encode(image_bytes(img)).decode("ascii")} for img in images]
    else:
        body["vector"] = np.asarray(vector, dtype=np.float64).reshape(-1).tolist()
    return Call("POST", "/v1/search", json=body)


MODELS_CALL = Call("GET", "/v1/models")


# ------------------------------------------------------------------------------------------- answers
def read_npy(response: httpx.Response) -> np.ndarray:
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != NPY_MEDIA_TYPE:
        raise ResponseFormatError(f"expected {NPY_MEDIA_TYPE}, got {media or 'no Content-Type'}")
    try:
        array = np.load(io.BytesIO(response.content), allow_pickle=False)
    except ValueError as exc:
        raise ResponseFormatError(f"the .npy answer cannot be read: {exc}") from exc
    if not isinstance(array, np.ndarray):
        raise ResponseFormatError("the .npy answer is not one array")
    return array


def read_provenance(response: httpx.Response) -> dict[str, Any]:
    """The ``X-Vitembed-*`` headers of a ``.npy`` answer as the JSON answer's ``provenance`` object
    (``X-Vitembed-Preprocess-Hash`` -> ``preprocess_hash``), plus ``dim`` and ``grids``."""
    facts: dict[str, Any] = {}
    for name, value in response.headers.items():
        if not name.lower().startswith(PROVENANCE_PREFIX):
            continue
        key = name.lower().removeprefix(PROVENANCE_PREFIX).replace("-", "_")
        try:
            facts[key] = json.loads(value) if key in _JSON_PROVENANCE else value
        except ValueError as exc:
            raise ResponseFormatError(f"the {name} header is not JSON: {value[:64]!r}") from exc
    return facts


def read_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise ResponseFormatError(f"the answer is not JSON: {exc}") from exc


def read_models(response: httpx.Response) -> list[Model]:
    body = read_json(response)
    return [
        Model(id=m["id"], default=bool(m.get("default")), info=dict(m.get("info") or {}))
        for m in body["data"]
    ]


def read_search(response: httpx.Response) -> SearchResult:
    body = read_json(response)
    hits = [
        [
            Hit(id=str(h["id"]), score=float(h["score"]), metadata=dict(h.get("metadata") or {}))
            for h in q["results"]
        ]
        for q in body["data"]
    ]
    return SearchResult(index=body["index"], k=int(body["k"]), hits=hits, provenance=dict(body["provenance"]))
