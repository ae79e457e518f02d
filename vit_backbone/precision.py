"""Choosing a compute precision: bfloat16 autocast only where the hardware runs it natively and only if
the embeddings it gives stay close to float32's.

On a CPU without native bfloat16 (no AMX / AVX512-BF16) autocast emulates it and is *slower* than
float32; on this project's reference machine (AMX) it is ~3x faster at batch 8.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    from .backbone import Backbone

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
MIN_COSINE = 0.999


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    return bool(set(NATIVE_BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def pick_device(requested: str) -> torch.device:
    """``auto`` takes CUDA when present; an explicit ``cuda`` without a GPU is an error, not a fallback."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA GPU; use 'cpu' or 'auto'")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype to try for a precision setting on a device; None = plain float32."""
    if precision == "float32":
        return None
    if precision == "float16":
        if device.type != "cuda":
            raise ValueError("precision 'float16' needs a CUDA device; on CPU use 'bfloat16' or 'auto'")
        return torch.float16
    if precision == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else None


def min_cosine(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Smallest row-wise cosine similarity between two [N, F] arrays."""
    a = reference.reshape(len(reference), -1).astype(np.float64)
    b = candidate.reshape(len(candidate), -1).astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)
    return float(cos.min())


def to_device(pixel_values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host batch → model device. For an accelerator the batch is copied through page-locked memory with a
    non-blocking copy, so the transfer overlaps work already queued on the device; on CPU it is a no-op."""
    if device.type == "cpu":
        return pixel_values
    return pixel_values.pin_memory().to(device, non_blocking=True)  # [B, 3, H, W]


SLOWER_VETO = 1.25  # auto: bfloat16 is dropped only when it takes > 1.25x float32's time (timings are noisy)
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class PrecisionChoice:
    """What a precision setting resolved to on this backbone's device."""

    dtype: torch.dtype | None  # the autocast dtype; None = plain float32
    label: str  # "float32" | "bfloat16" | "float16"
    min_cosine: float | None  # measured against float32 on the probe images; None when not measured
    seconds: tuple[float, float] | None = None  # (float32, low precision) probe times, when timed

    def describe(self) -> str:
        if self.dtype is None or self.min_cosine is None:
            return self.label
        return f"{self.label} autocast (min cosine {self.min_cosine:.5f} to float32)"


def probe_images() -> list[Image.Image]:
    """Deterministic textured images of four aspect ratios (no data files needed): what the precision rule
    measures on, and what the server warms up with."""
    rng = np.random.default_rng(0)
    images = []
    for height, width in ((480, 640), (600, 400), (512, 512), (300, 900)):
        yy, xx = np.mgrid[0:height, 0:width]
        base = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 127 // (height + width)], -1)
        noise = rng.integers(0, 64, size=(height, width, 3))
        images.append(Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)))  # [H, W, 3] uint8
    return images


def choose_autocast(
    backbone: Backbone,
    precision: str,
    images: Sequence[Any],
    *,
    batch_size: int = 8,
    native_bf16: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
    **embed_options: Any,
) -> PrecisionChoice:
    """The one precision rule of vitembed (the server and the catalog job both use it).

    ``float32`` / ``bfloat16`` / ``float16`` are honoured as given (``float16`` only on CUDA; the cosine to
    float32 is measured for information). ``auto`` tries bfloat16 only where it is native (CUDA, or a CPU
    with AMX / AVX512-BF16: emulated bfloat16 is slower) and keeps it only if its vectors keep cosine
    ≥ ``MIN_COSINE`` to float32 on ``images`` and it is not clearly slower (> ``SLOWER_VETO`` × float32's
    time). Each precision is warmed up on the same images at the same batch size before it is timed, so
    neither timing pays first-call costs the other does not. ``embed_options`` (pooling, layers, size,
    policy) are passed to ``backbone.embed`` so the check measures the vectors that will be used.
    ``backbone.autocast`` is restored; the caller applies ``choice.dtype``. ``native_bf16`` overrides the
    CPU-flag check (None: read /proc/cpuinfo); ``clock`` is what the two timed passes are measured with.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    device = backbone.device
    if precision == "auto":
        native = device.type == "cuda" or (cpu_has_native_bf16() if native_bf16 is None else native_bf16)
        dtype = torch.bfloat16 if native else None
    else:
        dtype = autocast_dtype(precision, device)
    if dtype is None:
        return PrecisionChoice(dtype=None, label="float32", min_cosine=None)
    label = str(dtype).removeprefix("torch.")
    previous = backbone.autocast
    try:
        backbone.autocast = None
        reference, fp32_s = _timed_embed(backbone, images, batch_size, embed_options, clock)
        backbone.autocast = dtype
        candidate, low_s = _timed_embed(backbone, images, batch_size, embed_options, clock)
    finally:
        backbone.autocast = previous
    cosine = min_cosine(reference, candidate)
    if precision == "auto" and (cosine < MIN_COSINE or low_s > SLOWER_VETO * fp32_s):
        return PrecisionChoice(dtype=None, label="float32", min_cosine=cosine, seconds=(fp32_s, low_s))
    return PrecisionChoice(dtype=dtype, label=label, min_cosine=cosine, seconds=(fp32_s, low_s))


def _timed_embed(
    backbone: Backbone,
    images: Sequence[Any],
    batch_size: int,
    options: dict[str, Any],
    clock: Callable[[], float],
) -> tuple[np.ndarray, float]:
    """One untimed pass (first-call costs: kernels, allocator, autocast caches), then the timed one, both
    on the same images at the same batch size."""
    backbone.embed(list(images), batch_size=batch_size, **options)
    started = clock()
    vectors = backbone.embed(list(images), batch_size=batch_size, **options)  # [N, F]
    return vectors, clock() - started
