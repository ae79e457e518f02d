"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=schemathesis_hooks``): the image formats of vitembed's OpenAPI
document produce real images, so that schema-valid requests are valid requests.

- ``image-data-uri``: a ``data:image/jpeg;base64,...`` or ``data:image/png;base64,...`` URI;
- ``image-base64``: the base64 of a JPEG or PNG file;
- multipart parts whose encoding is ``image/*``: the bytes of a file of that type (JPEG, PNG, WebP, GIF,
  BMP or TIFF);
- ``POST /v1/patch-similarity``: a schema-valid ``id`` or ``index`` of a generated body is replaced by one
  the test server holds (items p0.jpg..p3.jpg of index photos) in most cases, as a client that searched
  would send; a value is replaced only by another schema-valid one, so negative cases stay negative.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import schemathesis
from hypothesis import strategies as st
from PIL import Image
from schemathesis import Case, HookContext

FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF"}


def _encode(seed: int, width: int, height: int, kind: str) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, kind)
    return buffer.getvalue()


def images(*kinds: str) -> st.SearchStrategy[tuple[str, bytes]]:
    return st.builds(
        lambda seed, width, height, kind: (kind, _encode(seed, width, height, kind)),
        st.integers(0, 1000),
        st.integers(16, 96),
        st.integers(16, 96),
        st.sampled_from(kinds),
    )


IMAGES = images("JPEG", "PNG")

schemathesis.openapi.format(
    "image-data-uri",
    IMAGES.map(lambda pair: f"data:image/{pair[0].lower()};base64,{base64.b64encode(pair[1]).decode()}"),
)
schemathesis.openapi.format("image-base64", IMAGES.map(lambda pair: base64.b64encode(pair[1]).decode()))
for _subtype, _kind in FORMATS.items():
    schemathesis.openapi.media_type(f"image/{_subtype}", images(_kind).map(lambda pair: pair[1]))


ITEMS = ("p0.jpg", "p1.jpg", "p2.jpg", "p3.jpg")


@schemathesis.hook
def map_case(context: HookContext, case: Case) -> Case:
    body = case.body
    if case.operation.label != "POST /v1/patch-similarity" or not isinstance(body, dict):
        return case
    item, index = body.get("id"), body.get("index")
    if isinstance(item, str) and 1 <= len(item) <= 1024 and len(item) % 5:
        body["id"] = ITEMS[len(item) % len(ITEMS)]
    if isinstance(index, str) and 1 <= len(index) <= 128 and len(index) % 5:
        body["index"] = "photos"
    return case
