"""Request and response models, and the parsing of the three request shapes into (images, options).

``POST /v1/embed`` takes images as multipart parts named ``image`` or as JSON ``{"images": [{"base64"}]}``;
its options may come as form fields, JSON fields or query parameters (each option from one place only).
``POST /v1/embeddings`` is OpenAI's shape with ``data:image/...;base64,`` URIs. Option values are bounded in
length so that no error message can echo more than a few dozen characters of what the client sent.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from python_multipart.multipart import (
    MultipartParseError,
    MultipartParser,
    MultipartState,
    parse_options_header,
)

from vitembed.server.errors import ApiError, describe_validation_errors

Dtype = Literal["float32", "float16"]
Encoding = Literal["float", "base64"]

OptionsT = TypeVar("OptionsT", bound=BaseModel)
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
)
_MAX_LAYERS = 64
_MAX_HEADS = 16
_BASE64_WHITESPACE = str.maketrans("", "", " \t\r\n")
_INTS = re.compile(r"^\s*-?\d{1,6}\s*(,\s*-?\d{1,6}\s*)*$")


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
        description="cls | pooler | mean | cls_mean | gem | patch | linear_eval (default: the model's)",
    )
    layers: tuple[int, ...] | None = Field(
        None, description="0-based blocks, negative from the end: -1, or -4,-3,-2,-1 (a list in JSON)"
    )
    size: tuple[int, int] | None = Field(None, description="(H, W) in pixels: 224,224 (a list in JSON)")
    policy: str | None = Field(
        None, min_length=1, max_length=32, description="crop | squash | pad | dynamic (default: the model's)"
    )
    normalize: bool = Field(False, description="L2-normalise each vector")
    dtype: Dtype = Field("float32", description="float32 | float16 (JSON floats are rounded to it)")
    encoding: Encoding = Field("float", description="float (JSON numbers) | base64 (little-endian bytes)")
    return_grid: bool | None = Field(
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
        if isinstance(value, str):
            value = _split_ints(value.lower().replace("x", ","), "size", "224,224")
            if len(value) != 2:
                raise ValueError("size must be two whole numbers H,W, e.g. 224,224")
        return value

    @field_validator("size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError("size must be two positive whole numbers H,W, e.g. 224,224")
        return value


class EmbedQuery(BaseModel):
    """The same options as query parameters (raw text, validated with the body's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="a served model name")
    pooling: str | None = Field(
        None, description="cls | pooler | mean | cls_mean | gem | patch | linear_eval"
    )
    layers: str | None = Field(None, description="-1 or -4,-3,-2,-1")
    size: str | None = Field(None, description="H,W e.g. 224,224")
    policy: str | None = Field(None, description="crop | squash | pad | dynamic")
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
    precision: str


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
    dimensions: int | None = Field(None, description="not supported: a backbone's width is fixed")
    user: str | None = Field(None, max_length=256, description="accepted and ignored")
    modality: Literal["image"] | None = Field(None, description="image (infinity's field); text is refused")


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


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


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ------------------------------------------------------------------------------------------- parsing
def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json(content_type: str | None) -> bool:
    kind = media_type(content_type)
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def decode_base64(text: str, index: int) -> bytes:
    """Standard or URL-safe alphabet, whitespace and missing padding tolerated; anything else is a 400."""
    compact = text.translate(_BASE64_WHITESPACE)
    compact += "=" * (-len(compact) % 4)
    altchars = b"-_" if ("-" in compact or "_" in compact) else None
    try:
        return base64.b64decode(compact, altchars=altchars, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(
            400,
            "invalid_base64",
            "the image is not valid base64 (standard or URL-safe alphabet)",
            index=index,
        ) from exc


def decode_data_uri(uri: str, index: int) -> bytes:
    """``data:image/<type>[;param=value]*;base64,<data>`` → bytes; URLs are refused (no fetching)."""
    head, comma, data = uri.partition(",")
    if head[:5].lower() != "data:":
        lowered = uri[:8].lower()
        if lowered.startswith(("http://", "https://")):
            message = "fetching image URLs is not offered; send the image as a data:image/...;base64, URI"
        else:
            message = "each input must be a data:image/...;base64, URI"
        raise ApiError(400, "invalid_data_uri", message, index=index)
    params = head[5:].split(";")
    if not comma or not params[0].lower().startswith("image/") or params[-1].lower() != "base64":
        raise ApiError(
            400, "invalid_data_uri", "each input must be a data:image/...;base64, URI", index=index
        )
    return decode_base64(data, index)


def parse_json_body(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ApiError(400, "invalid_json", "the body is not valid JSON") from exc
    if not isinstance(payload, dict):
        raise ApiError(422, "invalid_request", "the JSON body must be an object")
    return payload


def check_image_count(count: int, max_images: int) -> None:
    if count == 0:
        raise ApiError(
            400,
            "no_images",
            'no images: send multipart parts named \'image\', JSON {"images": [{"base64": ...}]}, '
            "or for /v1/embeddings a non-empty 'input'",
        )
    if count > max_images:
        raise ApiError(413, "too_many_images", f"{count} images in one request; the limit is {max_images}")


def validation_error(exc: ValidationError, *, index: int | None = None) -> ApiError:
    return ApiError(422, "invalid_request", describe_validation_errors(exc.errors()), index=index)


def parse_embed_json(
    body: bytes, max_images: int, *, option_names: Sequence[str] = OPTION_NAMES
) -> tuple[list[bytes], dict[str, Any]]:
    """JSON body → (image bytes, raw option values); ``option_names`` are the fields the route accepts."""
    payload = parse_json_body(body)
    images = payload.pop("images", [])
    if not isinstance(images, list):
        raise ApiError(422, "invalid_request", 'images must be a list of {"base64": ...} objects')
    check_image_count(len(images), max_images)
    unknown = [key for key in payload if key not in option_names]
    if unknown:
        raise ApiError(
            422, "invalid_request", f"unknown field {unknown[0][:64]!r}; options: {', '.join(option_names)}"
        )
    decoded: list[bytes] = []
    for index, item in enumerate(images):
        try:
            image = ImageIn.model_validate(item)
        except ValidationError as exc:
            raise validation_error(exc, index=index) from exc
        decoded.append(decode_base64(strip_data_prefix(image.base64), index))
    return decoded, payload


def strip_data_prefix(text: str) -> str:
    """A data URI in the base64 field is forgiven: keep what follows ``;base64,``."""
    if text[:5].lower() == "data:":
        head, _, data = text.partition(",")
        if head.lower().endswith(";base64"):
            return data
    return text


def parse_multipart(
    body: bytes, content_type: str, max_images: int, option_names: Sequence[str] = OPTION_NAMES
) -> tuple[list[bytes], dict[str, Any]]:
    """multipart/form-data → (parts named ``image`` in order, option fields named in ``option_names``).
    Parsed from memory with python-multipart's low-level parser, so that image parts arrive as bytes whether
    or not they carry a filename (Starlette's form parser turns filename-less parts into text)."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "invalid_multipart", "the multipart Content-Type has no boundary")
    parts: list[tuple[bytes, bytearray]] = []  # (Content-Disposition, data)
    header_name = bytearray()
    header_value = bytearray()
    current: dict[str, Any] = {}

    def on_part_begin() -> None:
        current.clear()
        current["disposition"] = b""
        current["data"] = bytearray()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        if bytes(header_name).lower() == b"content-disposition":
            current["disposition"] = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        current["data"].extend(data[start:end])

    def on_part_end() -> None:
        parts.append((current["disposition"], current["data"]))
        if len(parts) > max_images + len(option_names):
            raise ApiError(413, "too_many_images", f"too many parts; the limit is {max_images} images")

    callbacks: Any = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise ApiError(400, "invalid_multipart", "the multipart body is malformed") from exc
    except ValueError as exc:  # e.g. an over-long boundary
        raise ApiError(400, "invalid_multipart", "the multipart Content-Type is malformed") from exc
    if parser.state != MultipartState.END:
        raise ApiError(400, "invalid_multipart", "the multipart body ends before its closing boundary")

    images: list[bytes] = []
    fields: dict[str, Any] = {}
    for disposition, data in parts:
        _, options = parse_options_header(disposition)
        raw_name = options.get(b"name")
        if raw_name is None:
            raise ApiError(400, "invalid_multipart", "a multipart part has no name")
        name = raw_name.decode("utf-8", "replace")
        if name == "image":
            images.append(bytes(data))
            continue
        if name not in option_names:
            raise ApiError(
                422,
                "invalid_request",
                f"unknown form field {name[:64]!r}; options: {', '.join(option_names)}",
            )
        if name in fields:
            raise ApiError(422, "invalid_request", f"the option {name!r} is given twice")
        try:
            fields[name] = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(422, "invalid_request", f"the form field {name!r} is not UTF-8 text") from exc
    check_image_count(len(images), max_images)
    return images, fields


def merge_options(query: Mapping[str, Any], body: Mapping[str, Any]) -> EmbedOptionsIn:
    """``/v1/embed``'s options from the query and the body (see ``merge_into``)."""
    return merge_into(EmbedOptionsIn, query, body)


def merge_into(model: type[OptionsT], query: Mapping[str, Any], body: Mapping[str, Any]) -> OptionsT:
    """One option, one place: the same name in the query and the body is refused rather than guessed;
    the merged options are validated as ``model`` (a 422 naming the bad field)."""
    twice = sorted(set(query) & set(body))
    if twice:
        raise ApiError(
            422, "invalid_request", f"the option {twice[0]!r} is given both in the query and the body"
        )
    try:
        return model.model_validate({**query, **body})
    except ValidationError as exc:
        raise validation_error(exc) from exc


def parse_openai(body: bytes, max_images: int) -> tuple[OpenAIEmbeddingRequest, list[bytes]]:
    payload = parse_json_body(body)
    modality = payload.get("modality")
    if modality is not None and modality != "image":
        shown = modality[:32] if isinstance(modality, str) else type(modality).__name__
        raise ApiError(
            422,
            "modality_unsupported",
            f"modality {shown!r} is not served: these models embed images only; send images as "
            'data:image/...;base64, URIs with "modality": "image" (or leave modality out)',
        )
    raw_input = payload.get("input")
    if isinstance(raw_input, list):
        check_image_count(len(raw_input), max_images)
    try:
        request = OpenAIEmbeddingRequest.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    if request.dimensions is not None:
        raise ApiError(
            422,
            "dimensions_unsupported",
            "'dimensions' is not supported: a backbone's embedding width is fixed (see GET /v1/models)",
        )
    inputs = [request.input] if isinstance(request.input, str) else request.input
    return request, [decode_data_uri(uri, index) for index, uri in enumerate(inputs)]
