"""Exceptions raised by the library.

Every error carries a short machine-readable ``code`` so that an adapter (the HTTP service, the catalog
job) can map it to a status or an errors-file reason without parsing messages.
"""

from __future__ import annotations


class VitEmbedError(Exception):
    """Base class; ``code`` is stable, the message is for people."""

    code: str = "error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ModelNotFoundError(VitEmbedError):
    code = "model_not_found"


class UnsupportedModelError(VitEmbedError):
    code = "unsupported_model"


class ModelLoadError(UnsupportedModelError):
    """A checkpoint whose ``config.json`` cannot be used: a field that is missing with no default, null, or of
    the wrong type. ``path`` is the file and ``field`` the field (dotted inside ``vision_config``; None when
    the file is not a JSON object at all)."""

    code = "invalid_model_config"

    def __init__(self, message: str, *, path: str, field: str | None = None) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.field = field


class UnsafeCheckpointError(VitEmbedError):
    code = "unsafe_checkpoint"


class InvalidOptionError(VitEmbedError, ValueError):
    """An option value (pooling, layers, size, policy...) that cannot be honoured."""

    code = "invalid_option"


class ImageDecodeError(VitEmbedError, ValueError):
    """Bytes that are not an acceptable image. ``code`` says which rule they broke: empty, too_large
    (more bytes than ``DecodeLimits.max_bytes``), not_an_image, unsupported_format, truncated, zero_size,
    too_many_pixels, aspect_ratio."""

    code = "invalid_image"


class SizeError(InvalidOptionError):
    """A spatial size that is not a multiple of the patch, or outside the token budget."""

    code = "invalid_size"


class MissingExtraError(VitEmbedError, ImportError):
    code = "missing_extra"

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(
            f"{what} needs an optional dependency: pip install -e '.[{extra}]' (from a clone of vitembed)"
        )
