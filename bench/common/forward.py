"""The model-only reference: the forward pass the server and the catalog job run, timed on pre-made pixels.

``run_forward`` does what ``vitembed.engine`` does for a request with no options: ``Backbone.pooled`` with
the model's default pooling and layers and the letterbox validity mask (it stops at the deepest requested
block: the embedded default, mean of block 8, runs 9 of 12 blocks), then ``.float()``, under the autocast the
server chose. Timing anything else (all blocks, ``output_hidden_states``) would make the server look faster
than it is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vit_backbone import Backbone
from vit_backbone.precision import cpu_has_native_bf16
from vit_backbone.preprocess import stack, stack_valid

from .machine import CpuWindow

DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ForwardTiming:
    dtype: str
    batch_size: int
    images_per_s: float
    median_ms: float  # one forward pass of the whole batch
    runs: int
    background_cores: float = 0.0  # other processes' CPU use meanwhile (noise)


def measured_dtypes(precision: str = "auto") -> list[str]:
    """float32, plus bfloat16 where the CPU has native bf16 (or it was asked for)."""
    if precision == "float32":
        return ["float32"]
    if precision == "bfloat16" or cpu_has_native_bf16():
        return ["float32", "bfloat16"]
    return ["float32"]


@dataclass(frozen=True)
class Pixels:
    """A preprocessed batch as the engine stacks it: pixels and, when an image is letterboxed (policy pad),
    the per-patch validity mask that keeps the padding out of attention and pooling."""

    values: torch.Tensor  # [n, 3, H, W]
    valid: torch.Tensor | None  # [n, h, w]; None when nothing is letterboxed

    def __len__(self) -> int:
        return len(self.values)

    def repeat_to(self, batch_size: int) -> Pixels:
        """A batch of ``batch_size``, cycling through the images."""
        times = -(-batch_size // len(self.values))
        values = self.values.repeat(times, 1, 1, 1)[:batch_size].contiguous()  # [B, 3, H, W]
        valid = None if self.valid is None else self.valid.repeat(times, 1, 1)[:batch_size].contiguous()
        return Pixels(values, valid)  # valid: [B, h, w]


def pixel_batch(backbone: Backbone, jpegs: Sequence[bytes]) -> Pixels:
    """The JPEGs preprocessed as the server does with no options (the default preset's box: 98 px for the
    embedded model under default-v3, 224 px under default-v1/-v2)."""
    prepared = backbone.prepare(list(jpegs), policy=backbone.defaults.policy)
    pixels, _ = stack(prepared)  # [n, 3, H, W]
    return Pixels(pixels, stack_valid(prepared))


def run_forward(backbone: Backbone, batch: Pixels, dtype_name: str) -> torch.Tensor:
    """One forward pass as the engine runs it for the model's defaults: [B, F] float32."""
    backbone.autocast = DTYPES[dtype_name]
    layers = backbone.resolve_layers(backbone.defaults.layers)
    return backbone.pooled(batch.values, backbone.defaults.pooling, layers, valid=batch.valid).float()


def timed_repeats(run: Callable[[], object], *, budget_s: float, min_runs: int, warmup: int) -> list[float]:
    """Seconds per call: ``warmup`` untimed calls, then at least ``min_runs`` and at least ``budget_s``."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - started < budget_s:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def time_forward(
    backbone: Backbone,
    pixels: Pixels,
    dtype_name: str,
    batch_size: int,
    budget_s: float,
    tag: str = "",
    *,
    min_runs: int = 3,
) -> ForwardTiming:
    """Median time of ``run_forward`` on a batch of ``batch_size`` (the images repeated): two warm-up
    passes, then at least ``min_runs`` and at least ``budget_s`` seconds (``budget_s=0, min_runs=1``: one)."""
    batch = pixels.repeat_to(batch_size)
    window = CpuWindow()
    times = timed_repeats(
        lambda: run_forward(backbone, batch, dtype_name),
        budget_s=budget_s,
        min_runs=min_runs,
        warmup=min(2, min_runs),
    )
    background = window.cores()["background"]
    median = statistics.median(times)
    result = ForwardTiming(dtype_name, batch_size, batch_size / median, median * 1000, len(times), background)
    print(
        f"  {tag}forward {dtype_name:8s} bs={batch_size:<3d} {result.images_per_s:7.1f} img/s  "
        f"{result.median_ms:8.1f} ms/batch  ({len(times)} runs, background {background:.2f} cores)",
        flush=True,
    )
    return result
