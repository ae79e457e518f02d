"""The model-only reference: the forward pass the server and the catalog job run, timed on pre-made pixels.

``run_forward`` does what ``vitembed.engine`` does for a request with no options: ``Backbone.pooled`` with the
model's default pooling and layers (which stops at the deepest requested block: the embedded default, mean
of block 8, runs 9 of 12 blocks), then ``.float()``, under the autocast the server chose. Timing anything
else (all blocks, ``output_hidden_states``) would make the server look faster than it is.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vit_backbone import Backbone
from vit_backbone.precision import cpu_has_native_bf16
from vit_backbone.preprocess import stack

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


def pixel_batch(backbone: Backbone, jpegs: Sequence[bytes]) -> torch.Tensor:
    """The JPEGs preprocessed as the server does with no options: [n, 3, 224, 224] for the embedded model."""
    pixels, _ = stack(backbone.prepare(list(jpegs), policy=backbone.defaults.policy))
    return pixels  # [n, 3, H, W]


def repeat_to(pixels: torch.Tensor, batch_size: int) -> torch.Tensor:
    """[n, 3, H, W] → [batch_size, 3, H, W], cycling through the images."""
    return pixels.repeat(-(-batch_size // len(pixels)), 1, 1, 1)[:batch_size].contiguous()


def run_forward(backbone: Backbone, batch: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """One forward pass as the engine runs it for the model's defaults: [B, F] float32."""
    backbone.autocast = DTYPES[dtype_name]
    layers = backbone.resolve_layers(backbone.defaults.layers)
    return backbone.pooled(batch, backbone.defaults.pooling, layers).float()  # [B, F]


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
    pixels: torch.Tensor,
    dtype_name: str,
    batch_size: int,
    budget_s: float,
    tag: str = "",
    *,
    min_runs: int = 3,
) -> ForwardTiming:
    """Median time of ``run_forward`` on a batch of ``batch_size`` (the images repeated): two warm-up
    passes, then at least ``min_runs`` and at least ``budget_s`` seconds (``budget_s=0, min_runs=1``: one)."""
    batch = repeat_to(pixels, batch_size)  # [B, 3, H, W]
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
