"""Choosing a compute precision: bfloat16 autocast only where the hardware runs it natively and only if
the embeddings it gives stay close to float32's.

On a CPU without native bfloat16 (no AMX / AVX512-BF16) autocast emulates it and is *slower* than
float32; on this project's reference machine (AMX) it is ~3x faster at batch 8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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
