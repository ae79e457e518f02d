"""One catalog item → a preprocessed tensor, or an ``ItemFailure`` saying why not.

Shared by the local engine's worker threads and the Ray decode stage, so both read, decode (with JPEG
draft, like the server) and preprocess exactly alike, and record the same codes: the decoder's own
(``truncated``, ``not_an_image``, ``too_many_pixels``, …), ``read_error`` for a file that cannot be read,
and ``internal_error`` for anything unexpected — which is recorded too, never allowed to stop the job.
"""

from __future__ import annotations

from pathlib import Path

from vit_backbone.errors import ImageDecodeError, VitEmbedError
from vit_backbone.preprocess import Prepared, Preprocessor, ResizePolicy

from .error_log import ItemFailure
from .sources import SourceItem


class ItemError(Exception):
    """Raised by ``prepare_item``; carries the failure record for errors.jsonl."""

    def __init__(self, failure: ItemFailure) -> None:
        super().__init__(f"{failure.id}: {failure.code}: {failure.message}")
        self.failure = failure


def read_file(path: str, max_bytes: int) -> bytes:
    """The file's bytes; a file over the decoder's byte limit is refused before it is read into memory."""
    file = Path(path)
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise _ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if size > max_bytes:
        raise ImageDecodeError(
            f"the file has {size} bytes, over the limit of {max_bytes}; re-encode it smaller",
            code="too_large",
        )
    try:
        return file.read_bytes()
    except OSError as exc:
        raise _ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc


class _ReadError(Exception):
    pass


def failure_for(item: SourceItem, exc: BaseException) -> ItemFailure:
    if isinstance(exc, ItemError):
        return exc.failure
    if isinstance(exc, VitEmbedError):
        code = exc.code
    elif isinstance(exc, _ReadError):
        code = "read_error"
    else:
        code = "internal_error"
    message = " ".join(str(exc).split()) or type(exc).__name__
    if code == "internal_error":
        message = f"{type(exc).__name__}: {message}"
    return ItemFailure(id=item.id, path=item.path, code=code, message=message)


def prepare_item(
    item: SourceItem, preprocessor: Preprocessor, policy: ResizePolicy, size: tuple[int, int] | None
) -> Prepared:
    """Read and preprocess one image exactly as the server does (``draft=True``); raises ``ItemError``."""
    try:
        data = read_file(item.path, preprocessor.limits.max_bytes)
        return preprocessor(data, policy=policy, size=size, draft=True)
    except Exception as exc:
        raise ItemError(failure_for(item, exc)) from exc
