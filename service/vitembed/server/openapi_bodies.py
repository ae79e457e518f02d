"""The OpenAPI request bodies and option parameters of the image routes, derived from the pydantic option
models the routes validate with, so that the schema states what the parser accepts: enums for pooling,
policy and preset, the numeric bounds, at least one image part (``image/*``) or JSON image (format
``image-base64``), no unknown fields.

Options sent as text (query parameters, multipart form fields) are parsed by pydantic's lax mode: their
schemas are the text each accepts (booleans as any of pydantic's words, ``layers`` and ``size`` as
comma-separated numbers). ``maxItems`` of the image lists is the server's ``max_images_per_request``, set
by ``openapi.make_contract``. What no schema can state is left to the route's 422: a size that is not a
multiple of the patch or passes the token budget, a block or pooling the model does not have, a patch
outside the query's grid, a ``where`` predicate LanceDB cannot parse, a vector of the wrong width.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from vit_backbone.pooling import POOLINGS
from vit_backbone.preprocess import RESIZE_POLICIES
from vit_backbone.presets import PRESET_NAMES
from vitembed.server.schemas import OPTION_ALIASES

IMAGE_MEDIA_TYPES = "image/jpeg, image/png, image/webp, image/gif, image/bmp, image/tiff"
IMAGE_PART: dict[str, Any] = {
    "type": "array",
    "items": {"type": "string", "format": "binary"},
    "minItems": 1,
    "description": "image files, one part each (at most max_images_per_request)",
}
IMAGE_REF = {"$ref": "#/components/schemas/ImageIn"}
_BOOL_WORDS = ("true", "false", "t", "f", "yes", "no", "y", "n", "on", "off", "1", "0")
_INT6 = r"(0{0,5}[1-9]|0{0,4}[1-9]\d|0{0,3}[1-9]\d{2}|0{0,2}[1-9]\d{3}|0?[1-9]\d{4}|[1-9]\d{5})"
_HEAD = r"\s*[^,\s]([^,]{0,62}[^,\s])?\s*"  # a head name of 1 to 64 characters once stripped
# the text forms of the tuple options, as schemas.py's validators parse them
TEXT_FORMS: dict[str, dict[str, Any]] = {
    "layers": {
        "type": "string",
        "maxLength": 256,
        "pattern": r"^\s*-?\d{1,6}\s*(,\s*-?\d{1,6}\s*)*$",
        "examples": ["-1", "-4,-3,-2,-1"],
    },
    "size": {
        "type": "string",
        "pattern": rf"^\s*{_INT6}\s*([,xX]\s*{_INT6}\s*)?$",
        "examples": ["224,224", "224"],
    },
    "heads": {"type": "string", "pattern": rf"^\s*$|^{_HEAD}(,{_HEAD}){{0,15}}$", "examples": ["shapes"]},
}
# options whose values are a fixed set (the library's), though the pydantic models take any short text
ENUMS: dict[str, tuple[str, ...]] = {"pooling": POOLINGS, "policy": RESIZE_POLICIES, "preset": PRESET_NAMES}


def _caseless(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)


BOOL_TEXT = {"type": "string", "pattern": "^(" + "|".join(_caseless(w) for w in _BOOL_WORDS) + ")$"}


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, null]`` → X (a form field or query parameter cannot be null: it is left out)."""
    options = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    if len(options) != 1:
        return dict(schema)
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    return {**options[0], **rest}


def json_properties(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON properties, with the enums of ``ENUMS``."""
    properties: dict[str, Any] = copy.deepcopy(model.model_json_schema()["properties"])
    for name, values in ENUMS.items():
        if name in properties:
            properties[name] = {
                "anyOf": [{"type": "string", "enum": list(values)}, {"type": "null"}],
                "description": properties[name].get("description", ""),
            }
    heads = properties.get("heads")
    if heads is not None and heads.get("type") == "array":  # names of 1 to 64 characters, at most 16
        heads.update(maxItems=16)
        heads["items"] = {"type": "string", "minLength": 1, "maxLength": 64}
    for alias, name in OPTION_ALIASES.items():  # top_k for k: either one, not both (a 422)
        if name in properties:
            properties[alias] = {**properties[name], "description": f"alias of {name} (not both)"}
    for name, schema in properties.items():
        schema.pop("title", None)
        if name in ("row", "col"):
            schema["examples"] = [0]  # the first patch: in every grid
    if "size" in properties:  # (H, W), or one number for a square; the validators refuse a side below 1
        pair = properties["size"]["anyOf"][0]
        for item in pair.get("prefixItems", []):
            item["minimum"] = 1
        properties["size"]["anyOf"].insert(1, {"type": "integer", "minimum": 1})
    return properties


def text_properties(model: type[BaseModel]) -> dict[str, Any]:
    """The model's options as text (query parameters, form fields)."""
    out: dict[str, Any] = {}
    for name, schema in json_properties(model).items():
        plain = _not_null(schema)
        description = plain.get("description", "")
        if name in TEXT_FORMS:
            out[name] = {**TEXT_FORMS[name], "description": description}
        elif plain.get("type") == "boolean":
            out[name] = {**BOOL_TEXT, "description": description}
        else:
            out[name] = plain
    return out


def json_images(*, one: bool = False) -> dict[str, Any]:
    images: dict[str, Any] = {"type": "array", "items": IMAGE_REF, "minItems": 1}
    if one:
        images["maxItems"] = 1
    return images


def image_request_body(model: type[BaseModel], *, one: bool = False) -> dict[str, Any]:
    """Images as multipart parts named ``image`` or JSON ``{"images": [{"base64"}]}``, with ``model``'s
    options as form fields or JSON fields; ``one``: exactly one image."""
    form_images = dict(IMAGE_PART, maxItems=1, description="one image file") if one else dict(IMAGE_PART)
    json_props = json_properties(model)
    required = [name for name in model.model_json_schema().get("required", [])]
    return {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image", *required],
                    "properties": {"image": form_images, **text_properties(model)},
                    "additionalProperties": False,
                    **_not_both(model),
                },
                "encoding": {"image": {"contentType": IMAGE_MEDIA_TYPES}},
            },
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["images", *required],
                    "properties": {"images": json_images(one=one), **json_props},
                    "additionalProperties": False,
                    **_not_both(model),
                }
            },
        },
    }


def _not_both(model: type[BaseModel]) -> dict[str, Any]:
    """An option and its alias are not sent together (a 422)."""
    pairs = [[name, alias] for alias, name in OPTION_ALIASES.items() if name in model.model_fields]
    if not pairs:
        return {}
    return {"not": {"anyOf": [{"required": pair} for pair in pairs]}}


def typed_parameters(parameters: list[dict[str, Any]], model: type[BaseModel]) -> None:
    """Query parameters named like ``model``'s options get the option's text schema."""
    texts = text_properties(model)
    for parameter in parameters:
        if parameter.get("in") == "query" and parameter.get("name") in texts:
            parameter["schema"] = texts[parameter["name"]]
