"""Request bodies → (images, options): the three request shapes of the embedding routes, also used by the
search, heads and explorer routes.

``POST /v1/embed`` takes images as multipart parts named ``image`` or as JSON ``{"images": [{"base64"}]}``;
its options may come as form fields, JSON fields or query parameters (each option from one place only).
``POST /v1/embeddings`` is OpenAI's shape with ``data:image/...;base64,`` URIs. Multipart is parsed from
memory with python-multipart's low-level parser. Every failure is an ``ApiError`` naming what to send.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from python_multipart.multipart import (
    MultipartParseError,
    MultipartParser,
    MultipartState,
    parse_options_header,
)

from vitembed.server.errors import ApiError, describe_validation_errors
from vitembed.server.schemas import (
    OPTION_ALIASES,
    OPTION_NAMES,
    EmbedOptionsIn,
    ImageIn,
    OpenAIEmbeddingRequest,
)

OptionsT = TypeVar("OptionsT", bound=BaseModel)
_BASE64_WHITESPACE = str.maketrans("", "", " \t\r\n")


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
    unknown = [key for key in payload if not _accepted(key, option_names)]
    if unknown:
        raise ApiError(
            422, "invalid_request", f"unknown field {unknown[0][:64]!r}; options: {', '.join(option_names)}"
        )
    decoded: list[bytes] = []
    for index, item in enumerate(images):
        if not isinstance(item, dict):  # a bare string or number: say the shape, not a schema class name
            raise ApiError(
                422,
                "invalid_request",
                f'images[{index}] must be an object {{"base64": "<encoded image>"}}, not a '
                f'{_json_kind(item)}: send {{"images": [{{"base64": "..."}}]}}',
                index=index,
            )
        try:
            image = ImageIn.model_validate(item)
        except ValidationError as exc:
            raise validation_error(exc, index=index) from exc
        decoded.append(decode_base64(strip_data_prefix(image.base64), index))
    return decoded, payload


def _canonical(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options under their primary names (``top_k`` -> ``k``); both spellings in one place is a 422."""
    canonical: dict[str, Any] = {}
    for key, value in options.items():
        name = OPTION_ALIASES.get(key, key)
        if name in canonical:
            raise ApiError(422, "invalid_request", f"give {name!r} or its alias {key!r}, not both")
        canonical[name] = value
    return canonical


def _accepted(name: str, option_names: Sequence[str]) -> bool:
    """An option the route takes, under its name or an alias of it (``top_k`` for ``k``)."""
    return name in option_names or OPTION_ALIASES.get(name) in option_names


def _json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type (string, number, list, null...)."""
    kinds = {str: "string", bool: "boolean", int: "number", float: "number", list: "list"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


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
        if not _accepted(name, option_names):
            raise ApiError(
                422,
                "invalid_request",
                f"unknown form field {name[:64]!r}: images go in parts named 'image' "
                f"(curl -F image=@photo.jpg); options: {', '.join(option_names)}",
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
    query, body = _canonical(query), _canonical(body)
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
