"""The request and response models of the embedding and operations routes (pydantic; they are also the
OpenAPI schema). Option values are bounded in length so that no error message can echo more than a few
dozen characters of what the client sent. Turning a body into (images, options) is ``body_parser.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator

Dtype = Literal["float32", "float16"]
Encoding = Literal["float", "base64"]

OPTION_NAMES = (
    "model",
    "pooling",
    "layers",
    "size",
    "policy",
    "normalize",
    "dtype",
    "encoding",
    "return_grid",
    "heads",
    "preset",
)
_MAX_LAYERS = 64
_MAX_HEADS = 16
_INTS = re.compile(r"^\s*-?\d{1,6}\s*(,\s*-?\d{1,6}\s*)*$")

# One spelling per option across the CLI and HTTP: ``k`` is the result count (``--k``, ``k``); ``top_k``
# (``--top-k``) is accepted as an alias wherever ``k`` is.
OPTION_ALIASES: dict[str, str] = {"top_k": "k"}


def fold_aliases(data: Any) -> Any:
    """``{"top_k": 3}`` -> ``{"k": 3}`` (a ``mode="before"`` validator); both spellings at once is refused."""
    if not isinstance(data, dict):
        return data
    folded = dict(data)
    for alias, name in OPTION_ALIASES.items():
        if alias in folded:
            if name in folded:
                raise ValueError(f"give {name!r} or its alias {alias!r}, not both")
            folded[name] = folded.pop(alias)
    return folded


def not_bool(value: Any) -> Any:
    """JSON true/false is not a number (pydantic's lax mode would read it as 1 or 0)."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not true or false")
    if isinstance(value, list | tuple) and any(isinstance(item, bool) for item in value):
        raise ValueError("must be numbers, not true or false")
    return value


def _not_number(value: Any) -> Any:
    """A JSON number is not true/false (lax mode would read 1 as true); text forms are parsed as words."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


NOT_BOOL = BeforeValidator(not_bool)  # numeric options: JSON true/false refused, as the schema says
FLAG = BeforeValidator(_not_number)  # boolean options: JSON numbers refused, as the schema says


def _split_ints(value: str, what: str, example: str) -> list[int]:
    if len(value) > 256 or not _INTS.match(value):
        raise ValueError(f"{what} must be whole numbers separated by commas, e.g. {example}")
    return [int(v) for v in value.split(",")]


# ------------------------------------------------------------------------------------------- /v1/embed
class EmbedOptionsIn(BaseModel):
    """Options of ``POST /v1/embed``; every one optional (``model``: the first served model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, min_length=1, max_length=128, description="a served model name")
    pooling: str | None = Field(
        None,
        min_length=1,
        max_length=32,
        description="cls | pooler | projection | mean | cls_mean | gem | patch | linear_eval "
        "(default: the model's)",
    )
    layers: tuple[int, ...] | None = Field(
        None, description="0-based blocks, negative from the end: -1, or -4,-3,-2,-1 (a list in JSON)"
    )
    size: tuple[int, int] | None = Field(
        None, description="(H, W) in pixels: 224,224 (a list in JSON), or one number for a square"
    )
    policy: str | None = Field(
        None,
        min_length=1,
        max_length=32,
        description="crop | squash | pad | dynamic | trim_squash | trim_pad (default: the model's)",
    )
    preset: str | None = Field(
        None,
        min_length=1,
        max_length=32,
        description="named defaults for the options not given: default-v3 (current) | default-v2 "
        "| default-v1",
    )
    normalize: Annotated[bool, FLAG] = Field(False, description="L2-normalise each vector")
    dtype: Dtype = Field("float32", description="float32 | float16 (JSON floats are rounded to it)")
    encoding: Encoding = Field("float", description="float (JSON numbers) | base64 (little-endian bytes)")
    return_grid: Annotated[bool | None, FLAG] = Field(
        None, description="include each image's patch grid (h, w); default: only for pooling=patch"
    )
    heads: tuple[str, ...] = Field(
        (), description="served heads to run on the same forward pass: a,b (a list in JSON)"
    )

    @field_validator("heads", mode="before")
    @classmethod
    def _parse_heads(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [name.strip() for name in value.split(",")] if value.strip() else []
        if isinstance(value, list | tuple):
            if len(value) > _MAX_HEADS:
                raise ValueError(f"heads must name at most {_MAX_HEADS} heads")
            if any(not isinstance(v, str) or not 1 <= len(v) <= 64 for v in value):
                raise ValueError("heads must be names of 1 to 64 characters")
        return value

    @field_validator("layers", mode="before")
    @classmethod
    def _parse_layers(cls, value: Any) -> Any:
        value = not_bool(value)
        if isinstance(value, str):
            value = _split_ints(value, "layers", "-1 or -4,-3,-2,-1")
        elif isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list | tuple) and not 1 <= len(value) <= _MAX_LAYERS:
            raise ValueError(f"layers must name 1 to {_MAX_LAYERS} blocks")
        return value

    @field_validator("size", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        value = not_bool(value)
        if isinstance(value, str):
            value = _split_ints(value.lower().replace("x", ","), "size", "224,224")
            if len(value) == 1:  # one number: a square, as on the CLI and in the library
                value = [value[0], value[0]]
            if len(value) != 2:
                raise ValueError("size must be one or two whole numbers: 224 (a square) or H,W, e.g. 224,224")
        elif isinstance(value, int) and not isinstance(value, bool):
            value = (value, value)
        return value

    @field_validator("size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError("size must be positive whole numbers: 224 (a square) or H,W, e.g. 224,224")
        return value


class EmbedQuery(BaseModel):
    """The same options as query parameters (raw text, validated with the body's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="a served model name")
    pooling: str | None = Field(
        None, description="cls | pooler | projection | mean | cls_mean | gem | patch | linear_eval"
    )
    layers: str | None = Field(None, description="-1 or -4,-3,-2,-1")
    size: str | None = Field(None, description="H,W e.g. 224,224, or one number for a square")
    policy: str | None = Field(None, description="crop | squash | pad | dynamic | trim_squash | trim_pad")
    preset: str | None = Field(None, description="default-v3 | default-v2 | default-v1")
    normalize: str | None = Field(None, description="true | false")
    dtype: str | None = Field(None, description="float32 | float16")
    encoding: str | None = Field(None, description="float | base64")
    return_grid: str | None = Field(None, description="true | false")
    heads: str | None = Field(None, description="served heads, comma-separated: a,b")


class ImageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base64: str = Field(description="the encoded image file (standard or URL-safe alphabet)")


class EmbedJsonRequest(EmbedOptionsIn):
    """``POST /v1/embed`` with ``Content-Type: application/json``."""

    images: list[ImageIn] = Field(description="one or more images, embedded in this order")


class EmbeddingOut(BaseModel):
    index: int
    embedding: list[Any] | str = Field(description="numbers (nested [h][w][F] for patch) or base64 bytes")
    grid: tuple[int, int] | None = Field(None, description="the effective patch grid (h, w)")


class Provenance(BaseModel):
    model: str
    revision: str
    preprocess_hash: str
    pooling: str
    layers: list[int] | None = Field(description="0-based blocks; null = the last block")
    normalized: bool
    dtype: Dtype
    policy: str
    interpolation: str
    preset: str = Field(description="the named defaults that filled in the options not given")
    size: list[int] | None = Field(
        None, description="the box [h, w] the images were prepared for (null: the model's native size)"
    )
    precision: Literal["float32", "bfloat16", "float16"] = Field(description="the precision the model ran in")
    precision_cosine: float | None = Field(
        description="smallest cosine of this precision's vectors to float32's on the start-up probe images "
        "(null: not measured, e.g. float32 or a precision given explicitly on the CPU)"
    )


class EmbedResponse(BaseModel):
    model: str
    dim: int
    data: list[EmbeddingOut]
    provenance: Provenance


# ------------------------------------------------------------------------------------------- OpenAI
class OpenAIEmbeddingRequest(BaseModel):
    """OpenAI's ``embeddings.create`` body; ``input`` items are ``data:image/...;base64,`` URIs."""

    model_config = ConfigDict(extra="forbid")

    input: str | list[str]
    model: str | None = Field(None, min_length=1, max_length=128)
    encoding_format: Encoding = "float"
    dimensions: int | None = Field(
        None,
        description="not supported (422 dimensions_unsupported): a backbone's width is fixed, and its "
        "features are not trained to be truncated",
    )
    normalize: StrictBool = Field(
        True,
        description="vitembed extra field: unit-length (L2) vectors, as OpenAI's embeddings are (default "
        "true); false returns the raw pooled features",
    )
    user: str | None = Field(None, max_length=256, description="accepted and ignored")
    modality: Literal["image"] | None = Field(None, description="image (infinity's field); text is refused")


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(
        description="unit length (L2 norm 1) unless the request set normalize=false; base64 = float32 "
        "little-endian"
    )


class OpenAIUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


# ------------------------------------------------------------------------------------------- misc
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vitembed"
    default: bool
    info: dict[str, Any] = Field(description="Backbone.info() plus the precision in use")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StatusOut(BaseModel):
    status: str


class ErrorDetail(BaseModel):
    code: str
    message: str
    index: int | None = Field(None, description="0-based position of the offending image")
    request_id: str
    limit: str | None = Field(
        None, description="quota_exceeded: the caller's limit, max_images_in_flight or images_per_second"
    )


class ErrorResponse(BaseModel):
    error: ErrorDetail
