"""Who is calling: the API keys the server accepts, each naming a caller with optional quotas.

Two ways to configure keys, usable together:

- ``VITEMBED_API_KEY``: one bearer token, the caller named ``default``, without quotas (as before);
- ``VITEMBED_API_KEYS_FILE`` (``--api-keys-file``): a JSON file naming callers, each with its key (or the
  key's SHA-256 in hex, so the file need not hold the secret) and optional limits::

      {"batch": {"key": "…", "max_images_in_flight": 16, "images_per_second": 8, "burst": 32},
       "web":   {"key_sha256": "9f86d08…"}}

The file is read once, when the settings are built (a bad file stops start-up with a one-line message);
only the keys' SHA-256 digests are kept in memory. A token is looked up by comparing its digest with every
caller's in constant time (``hmac.compare_digest``, no early exit), so timing reveals neither how much of
a guess was right nor which caller it matched. Caller names (never keys) label metrics and messages.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CALLER = "default"  # the caller of the single VITEMBED_API_KEY
MIN_KEY_CHARS = 16  # a key in the file must be at least this long (a guessable key is no key)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # metric label values, messages
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"key", "key_sha256", "max_images_in_flight", "images_per_second", "burst"}


@dataclass(frozen=True)
class Caller:
    """One API key's caller. Limits are ``None`` when not set (no limit)."""

    name: str
    digest: bytes  # SHA-256 of the key; the key itself is not kept
    max_images_in_flight: int | None = None  # images admitted and not yet answered, at once
    images_per_second: float | None = None  # token bucket refill rate, in images
    burst: float | None = None  # token bucket size (set whenever images_per_second is)

    @property
    def limited(self) -> bool:
        return self.max_images_in_flight is not None or self.images_per_second is not None

    def __repr__(self) -> str:  # never the digest either: nothing key-derived in logs
        return f"Caller({self.name!r})"


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class CallerKeys:
    """The accepted keys. ``keyed`` is false when none is configured: ``/v1`` is open, nobody has quotas."""

    def __init__(self, callers: Sequence[Caller] = ()) -> None:
        self.callers = tuple(callers)
        self.by_name = {caller.name: caller for caller in self.callers}

    @property
    def keyed(self) -> bool:
        return bool(self.callers)

    @property
    def limited(self) -> bool:
        return any(caller.limited for caller in self.callers)

    def identify(self, token: str | bytes) -> Caller | None:
        """The caller whose key ``token`` is, or None; the same work whatever the token."""
        digest = key_digest(token)
        found: Caller | None = None
        for caller in self.callers:  # every caller compared: the time does not depend on which matched
            if hmac.compare_digest(digest, caller.digest) and found is None:
                found = caller
        return found if token else None

    def __repr__(self) -> str:
        return f"CallerKeys({[caller.name for caller in self.callers]})"


def load_callers(path: Path | None, api_key: str | None) -> CallerKeys:
    """The callers of ``VITEMBED_API_KEY`` (``default``) and of the keys file; ``ValueError`` says what to
    fix."""
    callers: list[Caller] = []
    if api_key is not None:
        if not api_key:
            raise ValueError("api_key is empty: set VITEMBED_API_KEY to a secret, or unset it for no auth")
        callers.append(Caller(DEFAULT_CALLER, key_digest(api_key)))
    if path is not None:
        callers.extend(_read_file(path))
    names = [caller.name for caller in callers]
    if len(set(names)) != len(names):
        raise ValueError(
            f"api_keys_file {path}: the caller name {DEFAULT_CALLER!r} is taken by VITEMBED_API_KEY; "
            "rename that caller or move the single key into the file"
        )
    digests = [caller.digest for caller in callers]
    if len(set(digests)) != len(digests):
        raise ValueError(f"api_keys_file {path}: two callers share one key: give each caller its own key")
    return CallerKeys(callers)


def _read_file(path: Path) -> list[Caller]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"api_keys_file {path}: cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"api_keys_file {path}: not a JSON file ({exc})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(
            f'api_keys_file {path}: expected a JSON object of callers, e.g. {{"batch": {{"key": "..."}}}}'
        )
    return [_caller(path, name, entry) for name, entry in raw.items()]


def _caller(path: Path, name: str, entry: Any) -> Caller:
    where = f"api_keys_file {path}: caller {name[:64]!r}"
    if not _NAME.match(name):
        raise ValueError(f"{where}: a name is 1-64 of A-Z a-z 0-9 . _ - (it labels metrics)")
    if not isinstance(entry, Mapping):
        raise ValueError(f'{where}: expected an object such as {{"key": "...", "max_images_in_flight": 8}}')
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(_FIELDS)}")
    if ("key" in entry) == ("key_sha256" in entry):
        raise ValueError(f"{where}: give exactly one of key or key_sha256")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or key.strip() != key:
            raise ValueError(
                f"{where}: key must be a string of at least {MIN_KEY_CHARS} characters, without surrounding "
                "spaces"
            )
        digest = key_digest(key)
    else:
        hexed = entry["key_sha256"]
        if not isinstance(hexed, str) or not _SHA256_HEX.match(hexed):
            raise ValueError(f"{where}: key_sha256 must be 64 lower-case hex digits (sha256sum of the key)")
        digest = bytes.fromhex(hexed)
    in_flight = entry.get("max_images_in_flight")
    if in_flight is not None and (not _is_int(in_flight) or in_flight < 1):
        raise ValueError(f"{where}: max_images_in_flight must be a whole number >= 1 (or left out)")
    rate = _positive(where, "images_per_second", entry.get("images_per_second"))
    burst = _positive(where, "burst", entry.get("burst"))
    if burst is not None and rate is None:
        raise ValueError(f"{where}: burst needs images_per_second")
    if burst is not None and burst < 1:
        raise ValueError(f"{where}: burst must be >= 1 image")
    if rate is not None and burst is None:
        burst = max(1.0, rate)  # one second's worth
    return Caller(name, digest, in_flight, rate, burst)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(where: str, field: str, value: Any) -> float | None:
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {field} must be a number > 0 (or left out)")
    return float(value)
