"""DINOv2 (with or without registers) for inference in plain torch, without transformers' model code.

Why: importing ``transformers.models.dinov2.modeling_dinov2`` pulls in ``transformers.modeling_utils``,
``torch._dynamo``, ``torch.distributed.tensor`` and the loss registries: ~2.5 s on this machine class, more
than everything else between process start and the first forward pass of the embedded default. This module
is the same network (the same parameter names as transformers 5's ``Dinov2Model``, so ``Backbone``'s
position rule, block hooks and final norm work unchanged) and is held equal to transformers' forward pass by
``tests/vit_backbone/test_native_dinov2.py`` (hidden states, pooler, attention masks, registers, SwiGLU).

Only inference: no dropout, drop-path, masked-image tokens, gradient checkpointing or output attentions.
A checkpoint whose tensors do not map one to one onto this network (a head, an unknown layout) is not
loaded here: :func:`native_state_dict` returns None and the loader falls back to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .model_config import ModelConfig

NATIVE_FAMILIES = ("dinov2", "dinov2_registers")

# transformers 4.x names (what most checkpoints on disk hold) -> transformers 5 names (this module's)
_RENAMES = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
    (".mlp.weights_out.", ".mlp.down_proj."),
)
_IGNORED = ("embeddings.mask_token",)  # pre-training only


@dataclass(frozen=True)
class NativeOutput:
    """What ``Backbone`` reads of transformers' ``BaseModelOutputWithPooling``."""

    last_hidden_state: torch.Tensor  # [B, T, D], through the final norm
    pooler_output: torch.Tensor  # [B, D]: the normed CLS token
    hidden_states: tuple[torch.Tensor, ...] | None  # L+1 x [B, T, D]: embedding output, then every block


@dataclass(frozen=True)
class _Shape:
    dim: int
    depth: int
    heads: int
    patch: tuple[int, int]
    channels: int
    positions: int  # rows of the position table, CLS included
    registers: int
    eps: float
    mlp_hidden: int
    swiglu: bool
    qkv_bias: bool
    layerscale: float
    act: str


class _PatchEmbeddings(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.patch_size = s.patch
        self.projection = nn.Conv2d(s.channels, s.dim, kernel_size=s.patch, stride=s.patch)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pixel_values = pixel_values.to(self.projection.weight.dtype)  # [B, C, H, W]
        return self.projection(pixel_values).flatten(2).transpose(1, 2)  # [B, h*w, D]


class _Embeddings(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, s.dim))
        self.register_tokens = nn.Parameter(torch.zeros(1, s.registers, s.dim)) if s.registers else None
        self.patch_embeddings = _PatchEmbeddings(s)
        self.position_embeddings = nn.Parameter(torch.zeros(1, s.positions, s.dim))

    def interpolate_pos_encoding(self, embeddings: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The table as it is; ``Backbone`` replaces this per instance with its declared resampling rule."""
        if embeddings.shape[1] != self.position_embeddings.shape[1]:
            raise ValueError(
                f"a {height}x{width} input needs the position table resampled: load it through "
                "vit_backbone.load_backbone, which installs the family's interpolation rule"
            )
        return self.position_embeddings

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, _, height, width = pixel_values.shape
        patches = self.patch_embeddings(pixel_values)  # [B, h*w, D]
        tokens = torch.cat((self.cls_token.expand(batch, -1, -1), patches), dim=1)  # [B, 1 + h*w, D]
        tokens = tokens + self.interpolate_pos_encoding(tokens, height, width)  # [B, 1 + h*w, D]
        if self.register_tokens is not None:  # registers carry no position, after CLS
            registers = self.register_tokens.expand(batch, -1, -1)  # [B, R, D]
            tokens = torch.cat((tokens[:, :1], registers, tokens[:, 1:]), dim=1)  # [B, 1 + R + h*w, D]
        return tokens


class _Attention(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.head_dim = s.dim // s.heads
        self.scaling = self.head_dim**-0.5
        width = self.heads * self.head_dim
        self.q_proj = nn.Linear(s.dim, width, bias=s.qkv_bias)
        self.k_proj = nn.Linear(s.dim, width, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.dim, width, bias=s.qkv_bias)
        self.o_proj = nn.Linear(width, s.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q_proj(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        v = self.v_proj(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)  # [B, h, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))  # [B, T, D]


class _Mlp(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.fc1 = nn.Linear(s.dim, s.mlp_hidden)
        self.fc2 = nn.Linear(s.mlp_hidden, s.dim)
        self.act = s.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)  # [B, T, 4D]
        hidden = F.gelu(hidden, approximate="tanh") if self.act == "gelu_new" else F.gelu(hidden)
        return self.fc2(hidden)  # [B, T, D]


class _SwiGLU(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        hidden = (int(s.mlp_hidden * 2 / 3) + 7) // 8 * 8
        self.gate_proj = nn.Linear(s.dim, hidden)
        self.up_proj = nn.Linear(s.dim, hidden)
        self.down_proj = nn.Linear(hidden, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, D]


class _LayerScale(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.lambda1 = nn.Parameter(torch.full((s.dim,), s.layerscale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.lambda1


class _Block(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(s.dim, eps=s.eps)
        self.attention = _Attention(s)
        self.layer_scale1 = _LayerScale(s)
        self.norm2 = nn.LayerNorm(s.dim, eps=s.eps)
        self.mlp: nn.Module = _SwiGLU(s) if s.swiglu else _Mlp(s)
        self.layer_scale2 = _LayerScale(s)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.layer_scale1(self.attention(self.norm1(x), mask))  # [B, T, D]
        return x + self.layer_scale2(self.mlp(self.norm2(x)))  # [B, T, D]


class _Encoder(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.layer = nn.ModuleList([_Block(s) for _ in range(s.depth)])


class NativeDinov2(nn.Module):
    """``Dinov2Model`` / ``Dinov2WithRegistersModel`` for inference (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.shape = _shape(config)
        self.embeddings = _Embeddings(self.shape)
        self.encoder = _Encoder(self.shape)
        self.layernorm = nn.LayerNorm(self.shape.dim, eps=self.shape.eps)

    def forward(
        self,
        pixel_values: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> NativeOutput:
        """``attention_mask`` [B, T] (1 = a token others may attend to), as transformers takes it: masked
        tokens are left out as keys for every query."""
        x = self.embeddings(pixel_values)  # [B, T, D]
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(device=x.device, dtype=torch.bool)[:, None, None, :]  # [B, 1, 1, T]
        hidden = [x] if output_hidden_states else None
        for block in self.encoder.layer:
            x = block(x, mask)  # [B, T, D]
            if hidden is not None:
                hidden.append(x)
        last = self.layernorm(x)  # [B, T, D]
        return NativeOutput(last, last[:, 0], tuple(hidden) if hidden is not None else None)


def _shape(config: ModelConfig) -> _Shape:
    values = config.values
    dim = config.dim
    act = values.get("hidden_act", "gelu")
    if act not in ("gelu", "gelu_new"):
        raise ValueError(f"native DINOv2 supports hidden_act gelu, not {act!r}")
    grid_h, grid_w = config.native_grid
    return _Shape(
        dim=dim,
        depth=config.depth,
        heads=config.heads,
        patch=config.patch_size,
        channels=config.channels,
        positions=grid_h * grid_w + 1,
        registers=config.num_registers,
        eps=float(values.get("layer_norm_eps", 1e-6)),
        mlp_hidden=int(dim * float(values.get("mlp_ratio", 4))),
        swiglu=bool(values.get("use_swiglu_ffn", False)),
        qkv_bias=bool(values.get("qkv_bias", True)),
        layerscale=float(values.get("layerscale_value", 1.0)),
        act=str(act),
    )


def native_state_dict(folder: Path, model: NativeDinov2) -> dict[str, torch.Tensor] | None:
    """The folder's tensors under this module's names, or None when they are not exactly this network
    (then transformers loads it, with its own renaming and checks)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        loaded.update(load_file(str(file)))
    renamed: dict[str, torch.Tensor] = {}
    for key, tensor in loaded.items():
        name = key.removeprefix("dinov2.").removeprefix("dinov2_with_registers.")
        if name in _IGNORED:
            continue
        name = f".{name}"
        for old, new in _RENAMES:
            name = name.replace(old, new)
        name = name[1:]
        if name.endswith((".mlp.weights_in.weight", ".mlp.weights_in.bias")):  # SwiGLU: gate and up, stacked
            stem, _, leaf = name.rpartition(".mlp.weights_in.")
            gate, up = tensor.chunk(2, dim=0)
            renamed[f"{stem}.mlp.gate_proj.{leaf}"] = gate
            renamed[f"{stem}.mlp.up_proj.{leaf}"] = up
            continue
        renamed[name] = tensor
    expected = model.state_dict()
    if set(renamed) != set(expected):
        return None
    if any(renamed[k].shape != v.shape for k, v in expected.items()):
        return None
    return renamed


def load_native(folder: Path, config: ModelConfig, dtype: torch.dtype) -> NativeDinov2 | None:
    """The checkpoint as a :class:`NativeDinov2`, or None if it is not a plain DINOv2 vision tower."""
    if config.spec.name not in NATIVE_FAMILIES:
        return None
    try:
        with torch.device("meta"):  # shapes and names only: the weights come from the file
            model = NativeDinov2(config)
    except ValueError:
        return None
    state = native_state_dict(folder, model)
    if state is None:
        return None
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype).eval()
