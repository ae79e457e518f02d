"""Schemathesis hooks (``SCHEMATHESIS_HOOKS=schemathesis_hooks``): the image formats of vitembed's OpenAPI
document produce real images, so that schema-valid requests are valid requests.

- ``image-data-uri``: a ``data:image/jpeg;base64,...`` or ``data:image/png;base64,...`` URI;
- ``image-base64``: the base64 of a JPEG or PNG file;
- multipart parts whose encoding is ``image/*``: the bytes of a JPEG or PNG file.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import schemathesis
from hypothesis import strategies as st
from PIL import Image


def _encode(seed: int, width: int, height: int, kind: str) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, kind)
    return buffer.getvalue()


IMAGES = st.builds(
    lambda seed, width, height, kind: (kind, _encode(seed, width, height, kind)),
    st.integers(0, 1000),
    st.integers(16, 96),
    st.integers(16, 96),
    st.sampled_from(["JPEG", "PNG"]),
)

schemathesis.openapi.format(
    "image-data-uri",
    IMAGES.map(lambda pair: f"data:image/{pair[0].lower()};base64,{base64.b64encode(pair[1]).decode()}"),
)
schemathesis.openapi.format("image-base64", IMAGES.map(lambda pair: base64.b64encode(pair[1]).decode()))
schemathesis.openapi.media_type("image/jpeg", IMAGES.filter(lambda p: p[0] == "JPEG").map(lambda p: p[1]))
schemathesis.openapi.media_type("image/png", IMAGES.filter(lambda p: p[0] == "PNG").map(lambda p: p[1]))
