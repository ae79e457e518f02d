"""What a patch size and a resolution cost, before any weights are loaded.

A ViT turns an H×W image into N = (H/P_h)(W/P_w) tokens, and every block's attention is quadratic in the
sequence length. Doubling the side quadruples N and multiplies the attention work by ~16, so the table this
module renders (tokens, GFLOPs, attention entries side by side for a few sizes) is what a user needs before
choosing a resolution. Everything here is analytic arithmetic on an :class:`~vit_backbone.architectures.Arch`
(the architecture and its parameter count live in :mod:`vit_backbone.architectures`); nothing imports torch
or transformers, so the CLI's ``inspect`` of a standard architecture stays instant.

Conventions (stated once, used everywhere; parameters are counted as :mod:`vit_backbone.architectures`
states):

* **FLOPs** are 2 × multiply-accumulates of the matrix products of one forward pass on one image: the
  patch-embedding convolution, per block the Q/K/V projections, the attention scores QKᵀ and the weighted
  sum AV over the full sequence (prefix tokens included), the output projection and the MLP (three
  matrices for SwiGLU), plus the pooler when the architecture has one. Bias additions, norms,
  activations, softmax, LayerScale, RoPE rotations and position-table resampling are not counted (each
  is O(N·D), well under 1%). This is what ``torch.utils.flop_counter.FlopCounterMode`` measures for the
  eager attention path.
* **Attention memory** is the score matrix of one layer for one image at fp32: heads × seq² × 4 bytes, in
  MB of 10⁶ bytes. It is what the eager attention path materialises per layer (fused kernels avoid it, but
  it is still the quadratic term that dominates at high resolution).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .architectures import Arch, count_params
from .errors import SizeError
from .preprocess_config import nearest_multiples
from .specs import spec_named

__all__ = [
    "STANDARD_SIDES",
    "CostReport",
    "cost_report",
    "cost_reports",
    "format_cost_table",
    "forward_flops",
    "standard_sizes",
]

# Square sides shown next to the requested size, rounded to the patch: the common inference resolutions.
STANDARD_SIDES: tuple[int, ...] = (224, 448, 518, 896)


# --------------------------------------------------------------------------------------------------------
# FLOPs and the cost report
# --------------------------------------------------------------------------------------------------------


def forward_flops(arch: Arch, grid: tuple[int, int]) -> int:
    """FLOPs (2 × MACs) of one forward pass on one image with a ``grid`` of patches; see the module
    docstring for what is counted."""
    d, i = arch.dim, arch.mlp_dim
    n = grid[0] * grid[1]
    s = n + arch.prefix_tokens
    macs = n * arch.patch[0] * arch.patch[1] * arch.channels * d  # patch embedding
    per_block = 3 * s * d * d  # Q, K, V
    per_block += 2 * s * s * d  # QKᵀ and AV, summed over heads
    per_block += s * d * d  # output projection
    per_block += (3 if arch.mlp_kind == "swiglu" else 2) * s * d * i
    macs += arch.depth * per_block
    if arch.has_pooler:
        if spec_named(arch.family).pooler == "tanh":  # ViT: dense + tanh on CLS
            macs += d * (arch.pooler_dim or d)
        else:  # SigLIP: one probe query attends over the N patch tokens, then out-proj and MLP
            macs += d * d + 2 * n * d * d + 2 * n * d + d * d + 2 * d * i
    return 2 * macs


@dataclass(frozen=True)
class CostReport:
    """What one input size costs on one architecture (one image, one forward pass)."""

    height: int
    width: int
    grid: tuple[int, int]
    tokens: int  # patch tokens N = (H/P_h)(W/P_w)
    seq_len: int  # N + prefix tokens: what attention is quadratic in
    patch_dim: int  # P_h·P_w·C raw values per patch
    dim: int  # width D
    params: int
    gflops: float  # 10⁹ FLOPs, 2 × MACs
    attn_entries_per_head: int  # seq_len², per head per layer
    attn_mb_per_layer: float  # heads × seq_len² × 4 bytes / 10⁶
    flops_vs_native: float  # gflops / gflops at the native resolution
    native: bool  # whether this is the size the position table was trained for

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def cost_report(arch: Arch, height: int, width: int, *, params: int | None = None) -> CostReport:
    """The cost of an H×W input. ``params`` replaces the analytic count (e.g. with the exact count of a real
    checkpoint from :func:`count_params_from_safetensors`).

    Raises SizeError when a side is not a positive multiple of the patch; the message names the nearest
    multiples.
    """
    for what, value, step in (("height", height, arch.patch[0]), ("width", width, arch.patch[1])):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SizeError(f"{what} must be a positive integer, got {value!r}")
        if value % step:
            raise SizeError(
                f"{what} {value} is not a multiple of the patch size {step}; "
                f"nearest multiples: {nearest_multiples(value, step)}"
            )
    grid = (height // arch.patch[0], width // arch.patch[1])
    tokens = grid[0] * grid[1]
    seq = tokens + arch.prefix_tokens
    flops = forward_flops(arch, grid)
    return CostReport(
        height=height,
        width=width,
        grid=grid,
        tokens=tokens,
        seq_len=seq,
        patch_dim=arch.patch[0] * arch.patch[1] * arch.channels,
        dim=arch.dim,
        params=count_params(arch) if params is None else params,
        gflops=flops / 1e9,
        attn_entries_per_head=seq * seq,
        attn_mb_per_layer=arch.heads * seq * seq * 4 / 1e6,
        flops_vs_native=flops / forward_flops(arch, arch.native_grid),
        native=grid == arch.native_grid,
    )


def standard_sizes(arch: Arch, *, include: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """The sizes a cost table shows: ``STANDARD_SIDES`` rounded to patch multiples, the native size, and
    ``include`` (the requested size, taken as is), ordered by token count."""
    sizes: set[tuple[int, int]] = {arch.native_size}
    for side in STANDARD_SIDES:
        sizes.add(
            (
                max(1, round(side / arch.patch[0])) * arch.patch[0],
                max(1, round(side / arch.patch[1])) * arch.patch[1],
            )
        )
    if include is not None:
        sizes.add(include)
    return sorted(sizes, key=lambda hw: (hw[0] * hw[1], hw))


def cost_reports(
    arch: Arch, sizes: Iterable[tuple[int, int]], *, params: int | None = None
) -> list[CostReport]:
    """One report per (height, width)."""
    return [cost_report(arch, h, w, params=params) for h, w in sizes]


def _group(value: int) -> str:
    return f"{value:,}"


def _decimal(value: float) -> str:
    """Two decimals, but three significant digits below 1 so tiny models do not print 0.00."""
    return f"{value:,.2f}" if value >= 1 or value == 0 else f"{value:.3g}"


def format_cost_table(
    reports: Sequence[CostReport], arch_name: str, *, requested: tuple[int, int] | None = None
) -> str:
    """A plain-text table with tokens, GFLOPs and attention entries side by side, so the quadratic growth
    of attention with the token count is visible in the numbers. ``requested`` marks that row with ``*``;
    the native size is marked ``n``."""
    headers = (
        "",
        "size",
        "grid",
        "tokens",
        "seq",
        "GFLOPs",
        "x native",
        "attn entries/head/layer",
        "attn MB/layer fp32",
    )
    rows = []
    for r in reports:
        mark = ("*" if requested == (r.height, r.width) else "") + ("n" if r.native else "")
        rows.append(
            (
                mark,
                f"{r.height}x{r.width}",
                f"{r.grid[0]}x{r.grid[1]}",
                _group(r.tokens),
                _group(r.seq_len),
                _decimal(r.gflops),
                f"{r.flops_vs_native:.2f}x",
                _group(r.attn_entries_per_head),
                _decimal(r.attn_mb_per_layer),
            )
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        # mark, size and grid left-aligned; the numbers right-aligned
        cells_widths = enumerate(zip(cells, widths, strict=True))
        parts = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in cells_widths]
        return "  ".join(parts).rstrip()

    out = [f"cost per image, {arch_name} (FLOPs = 2 x multiply-adds; attention over the full sequence)"]
    out.append(line(headers))
    out.append(line(["-" * w for w in widths]))
    out.extend(line(row) for row in rows)
    legend = "n = native size" + ("; * = requested" if requested is not None else "")
    out.append(legend)
    return "\n".join(out)
