"""Settings: flags and VITEMBED_* variables, validated when built."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from vitembed.settings import ServiceSettings, parse_model_args


def test_model_arguments() -> None:
    assert parse_model_args(["dino=/m/dinov2", "embedded"]) == {"dino": "/m/dinov2", "embedded": "embedded"}
    assert parse_model_args(["/models/clip-b16/"]) == {"clip-b16": "/models/clip-b16/"}
    with pytest.raises(ValueError, match="given twice"):
        parse_model_args(["a=x", "a=y"])
    with pytest.raises(ValueError, match="expected NAME=PATH_OR_ID"):
        parse_model_args(["=x"])


def test_environment_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VITEMBED_MAX_BATCH_SIZE", "16")
    monkeypatch.setenv("VITEMBED_MODELS", '{"dino": "/m/dinov2"}')
    settings = ServiceSettings()
    assert settings.max_batch_size == 16 and settings.models == {"dino": "/m/dinov2"}
    assert ServiceSettings(max_batch_size=4).max_batch_size == 4  # flags win over the environment


def test_invalid_values_are_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="max_batch_size"):
        ServiceSettings(max_batch_size=0)
    with pytest.raises(ValidationError, match="could never be admitted"):
        ServiceSettings(queue_size=4, max_images_per_request=8)
    with pytest.raises(ValidationError, match="serve at least one model"):
        ServiceSettings(models={})
    monkeypatch.setenv("VITEMBED_QUEUE_SIZE", "abc")
    with pytest.raises(ValidationError, match="queue_size"):
        ServiceSettings()
