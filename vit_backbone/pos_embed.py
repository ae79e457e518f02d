"""Resampling learned absolute position tables to any patch grid.

The three stacks disagree on how to do this, and the same checkpoint gets measurably different
embeddings from each, so the method is a declared part of every result:

- ``bicubic``: bicubic to the exact target size, no antialias (transformers for DINOv2, ViT, CLIP, SigLIP).
- ``bicubic_antialias``: the same with antialias (transformers for DINOv2 with registers; timm).
- ``bicubic_offset``: the DINOv2 reference code for models without registers: bicubic with
  ``scale_factor=(n + 0.1) / M`` and no antialias. The offset is the reference's "historical kludge"
  against floating-point error in the output size; the scale factor also changes the sampling
  positions, which is why it is not equal to ``bicubic``.

Resampling always runs in float32 (bicubic in half precision shifts the table), then casts back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .specs import ResampleMethod


def resample_patch_table(
    table: torch.Tensor,  # [1, M_h*M_w, D] patch rows only
    source_grid: tuple[int, int],
    target_grid: tuple[int, int],
    method: ResampleMethod,
) -> torch.Tensor:  # [1, h*w, D]
    if tuple(target_grid) == tuple(source_grid):
        return table
    m_h, m_w = source_grid
    h, w = target_grid
    dim = table.shape[-1]
    grid = table.reshape(1, m_h, m_w, dim).permute(0, 3, 1, 2).to(torch.float32)  # [1, D, M_h, M_w]
    if method == "bicubic_offset":
        scale = ((h + 0.1) / m_h, (w + 0.1) / m_w)
        out = F.interpolate(grid, scale_factor=scale, mode="bicubic", align_corners=False)  # [1, D, h, w]
        if tuple(out.shape[-2:]) != (h, w):  # the offset exists to make this impossible; check anyway
            raise RuntimeError(f"reference resampling produced {tuple(out.shape[-2:])}, expected {(h, w)}")
    else:
        out = F.interpolate(
            grid,
            size=(h, w),
            mode="bicubic",
            align_corners=False,
            antialias=method == "bicubic_antialias",
        )  # [1, D, h, w]
    return out.permute(0, 2, 3, 1).reshape(1, h * w, dim).to(table.dtype)  # [1, h*w, D]


def square_grid(num_positions: int) -> tuple[int, int]:
    """Checkpoints store a flat table; every family here trains on a square grid."""
    side = math.isqrt(num_positions)
    if side * side != num_positions:
        raise ValueError(f"position table has {num_positions} patch rows, which is not a square grid")
    return side, side


class PositionTableCache:
    """Resampled tables per (grid, dtype, device): resampling costs a bicubic pass over D channels,
    which is wasted work when every request at a given size asks for the same table."""

    def __init__(self, table: torch.Tensor, *, has_cls: bool, method: ResampleMethod) -> None:
        # table: [1, P + M_h*M_w, D] where P = 1 if has_cls else 0; detached (same storage) so that a
        # traced forward can hold the resampled tables as constants
        table = table.detach()
        self._prefix = table[:, :1] if has_cls else table[:, :0]  # [1, P, D]
        self._patches = table[:, 1:] if has_cls else table  # [1, M_h*M_w, D]
        self.source_grid = square_grid(self._patches.shape[1])
        self.method = method
        self._cache: dict[tuple[tuple[int, int], torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, grid: tuple[int, int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(grid), dtype, device)
        cached = self._cache.get(key)  # type: ignore[arg-type]
        if cached is None:
            with torch.no_grad():
                patches = resample_patch_table(self._patches.detach(), self.source_grid, grid, self.method)
                cached = torch.cat([self._prefix.detach(), patches], dim=1).to(device=device, dtype=dtype)
            self._cache[key] = cached  # type: ignore[index]
        return cached

    def __len__(self) -> int:
        return len(self._cache)


def image_box(covered: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(top, bottom, left, right) patch rows/cols of the image in an [h, w] bool mask; None = whole grid."""
    rows = torch.nonzero(covered.any(dim=1)).flatten()  # [n_rows]
    cols = torch.nonzero(covered.any(dim=0)).flatten()  # [n_cols]
    if len(rows) == 0 or len(cols) == 0:
        return None
    box = (int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1)
    return None if box == (0, covered.shape[0], 0, covered.shape[1]) else box


def letterbox_positions(
    positions: PositionTableCache,
    table: torch.Tensor,
    grid: tuple[int, int],
    boxes: Sequence[tuple[int, int, int, int] | None],
) -> torch.Tensor:
    """[B, P + h*w, D] position tables: each image's patches get the table resampled to the image's own
    sub-grid (as if it were the whole input); letterbox cells keep the full grid's (masked out anyway)."""
    out = table.repeat(len(boxes), 1, 1)  # [B, P + h*w, D]
    prefix = out.shape[1] - grid[0] * grid[1]
    for b, box in enumerate(boxes):
        if box is None:
            continue
        top, bottom, left, right = box
        sub = positions.get((bottom - top, right - left), dtype=table.dtype, device=table.device)
        cells = out[b, prefix:].view(grid[0], grid[1], -1)  # [h, w, D]
        cells[top:bottom, left:right] = sub[0, prefix:].view(bottom - top, right - left, -1)
    return out


def install_position_rule(
    embeddings: torch.nn.Module,
    table: torch.Tensor,
    *,
    has_cls: bool,
    method: ResampleMethod,
    patch_size: tuple[int, int],
    image_boxes: Callable[[], Sequence[tuple[int, int, int, int] | None] | None],
) -> PositionTableCache:
    """Route ``embeddings``' own position lookup through the declared rule and a per-grid cache.

    Every learned-table family in transformers calls ``embeddings.interpolate_pos_encoding(emb, H, W)``
    with pixel sizes; replacing it on the instance keeps the rest of transformers' forward untouched.
    ``image_boxes()`` gives the letterbox boxes of the batch in the forward pass (None: no letterbox).
    """
    if table.dim() == 2:  # nn.Embedding weight [P + N, D]
        table = table.unsqueeze(0)  # [1, P + N, D]
    positions = PositionTableCache(table, has_cls=has_cls, method=method)
    patch_h, patch_w = patch_size

    def interpolate_pos_encoding(embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        grid = (int(height) // patch_h, int(width) // patch_w)
        table = positions.get(grid, dtype=embeddings.dtype, device=embeddings.device)  # [1, P + h*w, D]
        boxes = image_boxes()
        if boxes is None or len(boxes) != embeddings.shape[0]:
            return table
        return letterbox_positions(positions, table, grid, boxes)  # [B, P + h*w, D]

    object.__setattr__(
        embeddings, "interpolate_pos_encoding", interpolate_pos_encoding
    )  # an instance override
    return positions
