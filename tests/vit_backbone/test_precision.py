"""Precision choice: native-bf16 detection, device selection, the cosine check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vit_backbone.precision import (
    autocast_dtype,
    cpu_flags,
    cpu_has_native_bf16,
    min_cosine,
    pick_device,
    to_device,
)


def test_native_bf16_needs_amx_or_avx512_bf16(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    assert {"amx_bf16", "avx512f"} <= cpu_flags(info)
    assert cpu_has_native_bf16({"avx512f", "amx_bf16"})
    assert cpu_has_native_bf16({"avx512_bf16"})
    assert not cpu_has_native_bf16({"avx2", "avx512f"})
    assert cpu_flags(tmp_path / "missing") == set()


def test_autocast_dtype_per_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert autocast_dtype("float32", cpu) is None
    assert autocast_dtype("bfloat16", cpu) is torch.bfloat16
    assert autocast_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert autocast_dtype("float16", torch.device("cuda")) is torch.float16
    with pytest.raises(ValueError, match="'float16' needs a CUDA device"):
        autocast_dtype("float16", cpu)
    monkeypatch.setattr("vit_backbone.precision.cpu_has_native_bf16", lambda: False)
    assert autocast_dtype("auto", cpu) is None  # emulated bf16 is slower than float32
    monkeypatch.setattr("vit_backbone.precision.cpu_has_native_bf16", lambda: True)
    assert autocast_dtype("auto", cpu) is torch.bfloat16


def test_device_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == torch.device("cuda")


def test_min_cosine() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    assert min_cosine(a, a * 3) == pytest.approx(1.0)
    assert min_cosine(a, np.array([[1.0, 1.0], [0.0, 1.0]])) == pytest.approx(np.sqrt(0.5))


def test_accelerator_copies_use_pinned_memory_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = torch.randn(2, 3, 28, 28)
    assert to_device(batch, torch.device("cpu")) is batch  # CPU: no copy at all

    pinned: list[torch.Tensor] = []
    copies: list[tuple[torch.device, bool]] = []
    real_to = torch.Tensor.to

    def fake_pin(self: torch.Tensor) -> torch.Tensor:  # no CUDA here: record the call, keep the data
        pinned.append(self)
        return self.clone()

    def recording_to(self: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        copies.append((torch.device(device), non_blocking))
        return real_to(self, device, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    moved = to_device(batch, torch.device("meta"))  # any non-CPU device takes the accelerator path
    assert pinned and pinned[0] is batch
    assert copies == [(torch.device("meta"), True)]
    assert moved.device.type == "meta" and moved.shape == batch.shape
