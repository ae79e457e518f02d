"""One catalog item → a preprocessed tensor, or an ``ItemFailure`` saying why not.

Shared by the local engine's worker threads and the Ray decode stage, so both read, decode (with JPEG
draft, like the server) and preprocess exactly alike, and record the same codes: the decoder's own
(``truncated``, ``not_an_image``, ``too_many_pixels``, …), ``read_error`` for a file that cannot be read,
and ``internal_error`` for anything unexpected — which is recorded too, never allowed to stop the job.
"""

from __future__ import annotations

import os
import stat

from vit_backbone.catalog.error_log import ItemFailure
from vit_backbone.catalog.sources import SourceItem
from vit_backbone.errors import ImageDecodeError, VitEmbedError
from vit_backbone.preprocess import Prepared, Preprocessor, ResizePolicy

READ_CHUNK = 1 << 20
INVALID_NAME = "invalid_name"


class CatalogItemError(Exception):
    """Raised by ``prepare_item``; carries the failure record for errors.jsonl."""

    def __init__(self, failure: ItemFailure) -> None:
        super().__init__(f"{failure.id}: {failure.code}: {failure.message}")
        self.failure = failure


def read_file(path: str, max_bytes: int) -> bytes:
    """The file's bytes, at most ``max_bytes`` (more is ``too_large``). Only regular files are read: a
    FIFO or device would block or never end, a directory is no image (``read_error``). The size is
    found by reading at most ``max_bytes + 1`` bytes, never from ``st_size`` (0 for /proc-like files,
    stale on some network mounts); ``O_NONBLOCK`` keeps the open itself from blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as exc:
        raise _ReadError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _ReadError(f"cannot read {path}: not a regular file")
        chunks: list[bytes] = []
        remaining = max_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, READ_CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise _ReadError(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if remaining <= 0:
        raise ImageDecodeError(
            f"the file has more than {max_bytes} bytes, the limit; re-encode it smaller", code="too_large"
        )
    return b"".join(chunks)


class _ReadError(Exception):
    pass


def failure_for(item: SourceItem, exc: BaseException) -> ItemFailure:
    if isinstance(exc, CatalogItemError):
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
    """Read and preprocess one image exactly as the server does (``draft=True``); raises
    ``CatalogItemError``."""
    if item.invalid:
        raise CatalogItemError(
            ItemFailure(id=item.id, path=item.path, code=INVALID_NAME, message=item.invalid)
        )
    try:
        data = read_file(item.path, preprocessor.limits.max_bytes)
        return preprocessor(data, policy=policy, size=size, draft=True)
    except Exception as exc:
        raise CatalogItemError(failure_for(item, exc)) from exc
