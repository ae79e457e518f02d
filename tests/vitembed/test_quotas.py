"""Per-caller quotas, deterministic: the rule on injected numbers, the book on an injected clock (admitted,
refused, ``Retry-After``), one caller at its quota leaving another's admissions unchanged, and the API keys
file (what it accepts, what stops start-up, keys compared by digest and never shown)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from vitembed.callers import Caller, CallerKeys, key_digest, load_callers
from vitembed.metrics import Metrics
from vitembed.server.errors import ApiError
from vitembed.server.quotas import IN_FLIGHT, RATE, QuotaBook, QuotaDecision, QuotaExceededError, decide_quota
from vitembed.settings import ServiceSettings

KEY_A = "alpha-key-0123456789"
KEY_B = "bravo-key-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def caller(
    name: str = "a", in_flight: int | None = None, rate: float | None = None, burst: float | None = None
) -> Caller:
    return Caller(name, key_digest(name * 20), in_flight, rate, burst if burst is not None else rate)


# ------------------------------------------------------------------------------------------- the rule
def test_the_rule_admits_within_both_limits_and_names_the_binding_one() -> None:
    rule = dict(max_in_flight=4, rate=2.0, burst=4.0)
    assert decide_quota(images=4, in_flight=0, tokens=4.0, **rule) == QuotaDecision(True)
    assert decide_quota(images=1, in_flight=4, tokens=4.0, **rule) == QuotaDecision(False, IN_FLIGHT, 1.0)
    # 3 images need 3 tokens: 1.5 missing at 2 per second
    assert decide_quota(images=3, in_flight=0, tokens=1.5, **rule) == QuotaDecision(False, RATE, 0.75)
    # both bind: the later retry is the one reported
    assert decide_quota(images=1, in_flight=4, tokens=-5.0, **rule) == QuotaDecision(False, RATE, 3.0)
    # no limits: anything passes
    free = dict(max_in_flight=None, rate=None, burst=None)
    assert decide_quota(images=64, in_flight=10_000, tokens=0.0, **free).admitted


def test_a_request_over_the_burst_waits_for_a_full_bucket_then_borrows() -> None:
    rule = dict(in_flight=0, max_in_flight=None, rate=1.0, burst=4.0)
    assert decide_quota(images=10, tokens=3.0, **rule) == QuotaDecision(False, RATE, 1.0)
    assert decide_quota(images=10, tokens=4.0, **rule) == QuotaDecision(True)


# ------------------------------------------------------------------------------------------- the book
def test_in_flight_images_are_held_until_released() -> None:
    book = QuotaBook(clock=Clock())
    a = caller(in_flight=3)
    first = book.acquire(a, 2)
    book.acquire(a, 1)
    assert book.in_flight(a) == 3
    with pytest.raises(QuotaExceededError) as refused:
        book.acquire(a, 1)
    assert (refused.value.limit, refused.value.retry_after) == (IN_FLIGHT, 1)
    assert refused.value.message == (
        "caller 'a' is over its quota: 3 of its max_images_in_flight=3 images are in flight; retry in 1 s"
    )
    first.release()
    first.release()  # twice is once
    assert book.in_flight(a) == 1
    book.acquire(a, 2)
    assert book.in_flight(a) == 3


def test_a_request_larger_than_the_in_flight_limit_is_413_never_429() -> None:
    with pytest.raises(ApiError) as too_many:
        QuotaBook(clock=Clock()).acquire(caller(in_flight=3), 4)
    assert (too_many.value.status, too_many.value.code) == (413, "too_many_images")
    assert "max_images_in_flight=3" in too_many.value.message


def test_the_token_bucket_refills_on_the_clock_and_says_when() -> None:
    clock = Clock()
    book = QuotaBook(clock=clock)
    a = caller(rate=2.0, burst=4.0)
    book.acquire(a, 4)  # the whole burst
    with pytest.raises(QuotaExceededError) as refused:
        book.acquire(a, 3)
    assert (refused.value.limit, refused.value.retry_after) == (RATE, 2)  # 3 tokens at 2 per second: 1.5 s
    assert "images_per_second=2 (burst 4)" in refused.value.message
    clock.now += 1.0  # 2 tokens back
    with pytest.raises(QuotaExceededError) as still:
        book.acquire(a, 3)
    assert still.value.retry_after == 1  # 0.5 s left, rounded up to whole seconds
    book.check(a, 2)  # 2 fit now; a check takes nothing
    book.acquire(a, 2)
    clock.now += 100.0  # refills only up to the burst
    book.acquire(a, 4)
    with pytest.raises(QuotaExceededError):
        book.acquire(a, 1)


def test_refusals_take_nothing_and_a_server_refusal_gives_the_tokens_back() -> None:
    clock = Clock()
    book = QuotaBook(clock=clock)
    a = caller(in_flight=8, rate=1.0, burst=2.0)
    hold = book.acquire(a, 2)
    for _ in range(50):
        with pytest.raises(QuotaExceededError):
            book.acquire(a, 1)
    assert book.in_flight(a) == 2
    hold.release(refund=True)  # e.g. the server's own admission refused the request: 429
    assert book.in_flight(a) == 0
    book.acquire(a, 2)  # the bucket is whole again, with no time passed


def test_a_caller_at_its_quota_leaves_another_callers_admissions_unchanged() -> None:
    """The same sequence of B's requests, on a book where A is pinned at both its limits and refused
    hundreds of times, and on a book A never used: B is admitted and refused identically."""
    a = caller("a", in_flight=2, rate=1.0, burst=2.0)
    b = caller("b", in_flight=5, rate=4.0, burst=4.0)

    def run_b(book: QuotaBook, clock: Clock) -> list[tuple[bool, str | None, int]]:
        outcomes: list[tuple[bool, str | None, int]] = []
        for step in range(12):
            clock.now += 0.25
            try:
                book.acquire(b, 1 + step % 3)
                outcomes.append((True, None, 0))
            except QuotaExceededError as refused:
                outcomes.append((False, refused.limit, refused.retry_after))
        return outcomes

    crowded_clock, quiet_clock = Clock(), Clock()
    crowded, quiet = QuotaBook(clock=crowded_clock), QuotaBook(clock=quiet_clock)
    crowded.acquire(a, 2)
    for _ in range(300):
        with pytest.raises(QuotaExceededError):
            crowded.acquire(a, 1)
    seen = run_b(crowded, crowded_clock)
    assert seen == run_b(quiet, quiet_clock)
    assert {admitted for admitted, _, _ in seen} == {True, False}  # B meets its own limits, and only those
    assert crowded.in_flight(a) == 2


def test_metrics_count_by_caller_name_never_by_key() -> None:
    metrics = Metrics()
    book = QuotaBook(metrics, clock=Clock())
    a = caller("batch", in_flight=1)
    hold = book.acquire(a, 1)
    with pytest.raises(QuotaExceededError):
        book.acquire(a, 1)
    text = metrics.render()[0].decode()
    assert 'vitembed_caller_requests_total{caller="batch",outcome="admitted"} 1.0' in text
    assert 'vitembed_caller_requests_total{caller="batch",outcome="max_images_in_flight"} 1.0' in text
    assert 'vitembed_caller_images_in_flight{caller="batch"} 1.0' in text
    hold.release()
    assert 'vitembed_caller_images_in_flight{caller="batch"} 0.0' in metrics.render()[0].decode()


# ------------------------------------------------------------------------------------------- the keys file
def write_keys(tmp_path: Path, callers: object) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(callers))
    return path


def test_the_keys_file_names_callers_with_keys_or_their_digests(tmp_path: Path) -> None:
    path = write_keys(
        tmp_path,
        {
            "batch": {"key": KEY_A, "max_images_in_flight": 16, "images_per_second": 8},
            "web": {
                "key_sha256": hashlib.sha256(KEY_B.encode()).hexdigest(),
                "burst": 3,
                "images_per_second": 1,
            },
        },
    )
    settings = ServiceSettings(api_keys_file=path, api_key="single-key")
    keys = settings.callers
    assert keys.keyed and keys.limited
    batch, web = keys.by_name["batch"], keys.by_name["web"]
    assert (batch.max_images_in_flight, batch.images_per_second, batch.burst) == (16, 8.0, 8.0)
    assert (web.max_images_in_flight, web.images_per_second, web.burst) == (None, 1.0, 3.0)
    assert keys.identify(KEY_A) is batch and keys.identify(KEY_B.encode()) is web
    assert keys.identify("single-key") is keys.by_name["default"]  # VITEMBED_API_KEY keeps working
    assert (
        keys.identify("") is None and keys.identify(KEY_A + "x") is None and keys.identify(KEY_A[:-1]) is None
    )
    shown = repr(settings) + repr(keys) + repr(batch)
    assert KEY_A not in shown and batch.digest.hex() not in shown and "batch" in repr(keys)


def test_without_keys_nobody_is_keyed() -> None:
    keys = ServiceSettings().callers
    assert not keys.keyed and not keys.limited
    assert CallerKeys().identify("anything") is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([], "expected a JSON object of callers"),
        ({"a b": {"key": KEY_A}}, "a name is 1-64 of A-Z a-z 0-9 . _ -"),
        ({"a": {"key": "short"}}, "key must be a string of at least 16 characters"),
        ({"a": {"key": KEY_A, "key_sha256": "00" * 32}}, "give exactly one of key or key_sha256"),
        ({"a": {}}, "give exactly one of key or key_sha256"),
        ({"a": {"key_sha256": "XYZ"}}, "key_sha256 must be 64 lower-case hex digits"),
        (
            {"a": {"key": KEY_A, "max_images_in_flight": 0}},
            "max_images_in_flight must be a whole number >= 1",
        ),
        (
            {"a": {"key": KEY_A, "max_images_in_flight": 2.5}},
            "max_images_in_flight must be a whole number >= 1",
        ),
        ({"a": {"key": KEY_A, "images_per_second": -1}}, "images_per_second must be a number > 0"),
        ({"a": {"key": KEY_A, "burst": 4}}, "burst needs images_per_second"),
        ({"a": {"key": KEY_A, "max_in_flight": 4}}, "unknown field(s) ['max_in_flight']"),
        ({"a": {"key": KEY_A}, "b": {"key": KEY_A}}, "two callers share one key"),
        ({"default": {"key": KEY_A}}, "the caller name 'default' is taken by VITEMBED_API_KEY"),
    ],
)
def test_a_bad_keys_file_stops_start_up_with_what_to_fix(
    tmp_path: Path, content: object, message: str
) -> None:
    with pytest.raises(ValueError, match="api_keys_file") as bad:
        load_callers(write_keys(tmp_path, content), "single-key")
    assert message in str(bad.value)
    assert KEY_A not in str(bad.value)


def test_an_unreadable_keys_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        ServiceSettings(api_keys_file=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        ServiceSettings(api_keys_file=tmp_path / "bad.json")
