"""``serialise.dumps``: the fast encoder must say exactly what ``json.dumps(allow_nan=False)`` said."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from vitembed.server.serialise import dumps


def _reference(payload: object) -> bytes:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def test_embedding_floats_parse_to_the_same_doubles() -> None:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((3, 384)).astype(np.float32)  # [n, F]
    vectors[0, :4] = [1e-5, -3.5e-7, 0.0, 65504.0]  # exponents both encoders write differently
    data = [{"index": i, "embedding": row.tolist()} for i, row in enumerate(vectors)]
    payload = {"model": "m", "data": data}
    parsed = json.loads(dumps(payload))
    assert parsed == json.loads(_reference(payload))
    got = np.array([item["embedding"] for item in parsed["data"]], dtype=np.float64)
    assert np.array_equal(got, vectors.astype(np.float64))  # bit-exact, not approximately


def test_compact_ascii_output_matches_the_standard_library() -> None:
    payload = {"message": "beyond the float16 range (±65504)", "grid": [16, 16], "none": None, "ok": True}
    assert dumps(payload) == _reference(payload)
    assert dumps(payload).isascii()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="not JSON compliant"):
        dumps({"data": [{"embedding": [0.5, bad]}]})


def test_a_string_naming_nan_is_not_mistaken_for_one() -> None:
    payload = {"model": "NaN-Infinity-net", "embedding": [0.25, -1.5]}
    assert json.loads(dumps(payload)) == payload
