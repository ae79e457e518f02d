"""The job's progress bar on stderr: images done, images/s, ETA and the failures so far (tqdm)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from vit_backbone.errors import MissingExtraError


def require_tqdm() -> None:
    """Import tqdm or name the extra that brings it (checked before any work starts)."""
    try:
        import tqdm
    except ImportError as exc:
        raise MissingExtraError("the embed-catalog progress bar", "catalog") from exc
    del tqdm


class ProgressBar:
    """``with ProgressBar(total) as bar: bar.update(n, failed)`` — quiet when stderr is not a terminal
    unless ``force`` (a log file gets the summary line, not thousands of carriage returns)."""

    def __init__(self, total: int, *, force: bool = False, description: str = "embedding") -> None:
        require_tqdm()
        from tqdm import tqdm

        self.failed = 0
        self._bar: Any = tqdm(
            total=total,
            unit="img",
            desc=description,
            file=sys.stderr,
            disable=False if force else None,  # None: only on a terminal
            dynamic_ncols=True,
            mininterval=0.5,
            smoothing=0.05,
        )

    def update(self, count: int, failed: int = 0) -> None:
        if failed:
            self.failed += failed
            self._bar.set_postfix(errors=self.failed, refresh=False)
        self._bar.update(count)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.close()
