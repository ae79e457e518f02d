"""When to retry and how long to wait: 429 and 503 answers (and connections that could not be opened) are
retried until a total deadline, waiting at least the server's ``Retry-After`` with jittered exponential
backoff, so that many clients refused together do not come back together."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from .errors import RETRYABLE_STATUSES, APIError, ConnectError, VitembedError

# 503s that a retry cannot cure: the server must be restarted first
PERMANENT_CODES = frozenset({"index_dropped"})


@dataclass(frozen=True)
class RetryPolicy:
    """``deadline``: seconds from the first attempt after which no retry starts (None: only
    ``max_attempts`` bounds it). The n-th wait (n = 0, 1, ...) is ``max(Retry-After, backoff)`` where
    backoff is drawn from [½, 1] × min(``max_backoff``, ``initial_backoff`` × 2ⁿ), plus up to ``jitter`` of
    Retry-After on top."""

    max_attempts: int = 10
    deadline: float | None = 60.0
    initial_backoff: float = 0.1
    max_backoff: float = 10.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.deadline is not None and self.deadline <= 0:
            raise ValueError(f"deadline must be positive seconds or None, got {self.deadline}")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ValueError("backoff must satisfy 0 <= initial_backoff <= max_backoff")

    def should_retry(self, error: VitembedError) -> bool:
        if isinstance(error, APIError):
            return error.status in RETRYABLE_STATUSES and error.code not in PERMANENT_CODES
        return isinstance(error, ConnectError)

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait after the ``attempt``-th failed attempt (0-based)."""
        growth: float = 2.0**attempt
        backoff = min(self.max_backoff, self.initial_backoff * growth) * rng.uniform(0.5, 1.0)
        if retry_after is None:
            return backoff
        return max(retry_after * (1 + rng.uniform(0, self.jitter)), backoff)


def next_wait(
    policy: RetryPolicy, error: VitembedError, attempt: int, started: float, rng: random.Random
) -> float | None:
    """Seconds to wait before attempt ``attempt + 1``, or None to give up with ``error``: not retryable,
    out of attempts, or the wait would end past the deadline (counted from ``started``, monotonic)."""
    if not policy.should_retry(error) or attempt + 1 >= policy.max_attempts:
        return None
    retry_after = error.retry_after if isinstance(error, APIError) else None
    wait = policy.delay(attempt, retry_after, rng)
    if policy.deadline is not None and time.monotonic() + wait - started > policy.deadline:
        return None
    return wait


NO_RETRY = RetryPolicy(max_attempts=1, deadline=None)
