"""The shape of a ViT-family vision backbone and its parameter count, before any weights are loaded.

An :class:`Arch` comes from a transformers config or a raw ``config.json`` (:func:`arch_from_hf_config`) or
from ``STANDARD_ARCHS``; :func:`count_params` counts its parameters analytically, and
:func:`count_params_from_safetensors` counts a real checkpoint's exactly from its safetensors headers
alone. Nothing here imports torch or transformers, so the CLI's ``inspect`` stays instant. What an input
size then costs (tokens, FLOPs, attention) is :mod:`vit_backbone.costs`.

**Parameters** are those of the vision backbone as transformers builds it: patch projection (+ bias),
CLS / register / mask tokens, the learned position table (rows for the native grid, plus one for CLS when
there is a CLS), the blocks, the final norm, and the pooler only when ``Arch.has_pooler``: ViT's dense+tanh
pooler, SigLIP's attention-pooling head. Classifier heads and CLIP's ``visual_projection`` are never
counted. The ``STANDARD_ARCHS`` ViT entries have ``has_pooler=False`` because the published ViT figures
(86M / 307M / 632M) are backbone-only (``ViTForImageClassification`` has no pooler either).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from .errors import InvalidOptionError, UnsupportedModelError
from .model_config import ModelConfig
from .specs import FamilyName, PosEmbedKind, parse_config, spec_named

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "STANDARD_ARCHS",
    "Arch",
    "Family",
    "MlpKind",
    "PosEmbedKind",
    "arch_from_hf_config",
    "count_params",
]

Family = FamilyName  # the public family names of vit_backbone.specs
MlpKind = Literal["mlp", "swiglu"]


@dataclass(frozen=True)
class Arch:
    """The shape of a ViT-family vision backbone: enough to count its parameters and FLOPs exactly.

    ``mlp_dim`` is the hidden width of the MLP; for SwiGLU it is the width of each of the gate/up branches
    (DINOv2-g: int(2/3·4·D) rounded up to a multiple of 8 = 4096).
    """

    family: Family
    patch: tuple[int, int]
    channels: int
    dim: int
    depth: int
    heads: int
    mlp_dim: int
    native_grid: tuple[int, int]
    pos_embed: PosEmbedKind
    cls_token: bool = True  # SigLIP has none
    registers: int = 0
    mlp_kind: MlpKind = "mlp"
    layerscale: bool = False
    has_pooler: bool = False  # ViT: dense+tanh on CLS; SigLIP: attention-pooling head (MAP)
    pooler_dim: int | None = None  # ViT's pooler_output_size; None means dim
    mask_token: bool = False  # DINOv2/v3 carry one (unused at inference, but it is a parameter)
    patch_bias: bool = True  # CLIP's patch convolution has no bias
    qkv_bias: tuple[bool, bool, bool] = (True, True, True)  # DINOv3 has no key bias
    proj_bias: bool = True
    mlp_bias: bool = True
    pre_norm: bool = False  # CLIP's pre_layrnorm before the first block

    def __post_init__(self) -> None:
        positive = {
            "channels": self.channels,
            "dim": self.dim,
            "depth": self.depth,
            "heads": self.heads,
            "mlp_dim": self.mlp_dim,
            "patch height": self.patch[0],
            "patch width": self.patch[1],
            "native grid height": self.native_grid[0],
            "native grid width": self.native_grid[1],
        }
        for what, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidOptionError(f"architecture {what} must be a positive integer, got {value!r}")
        if self.dim % self.heads:
            raise InvalidOptionError(f"width {self.dim} is not divisible by {self.heads} heads")
        if self.registers < 0:
            raise InvalidOptionError(f"registers must be >= 0, got {self.registers}")
        if self.has_pooler and not spec_named(self.family).has_pooler_weights:
            raise InvalidOptionError(f"{self.family} has no pooler; only vit and siglip do")

    @property
    def prefix_tokens(self) -> int:
        """Tokens before the patches: CLS (if any) plus registers."""
        return int(self.cls_token) + self.registers

    @property
    def native_size(self) -> tuple[int, int]:
        """The configured image size (what a learned position table was trained for), in pixels."""
        return self.native_grid[0] * self.patch[0], self.native_grid[1] * self.patch[1]

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the derived prefix_tokens / native_size included."""
        out = asdict(self)
        out["prefix_tokens"] = self.prefix_tokens
        out["native_size"] = list(self.native_size)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# --------------------------------------------------------------------------------------------------------
# Hugging Face configs
# --------------------------------------------------------------------------------------------------------


def _as_mapping(config: PretrainedConfig | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise UnsupportedModelError(
            f"expected a transformers config or a config.json mapping, got {type(config).__name__}"
        )
    result = to_dict()
    if not isinstance(result, Mapping):
        raise UnsupportedModelError(f"{type(config).__name__}.to_dict() did not return a mapping")
    return result


def arch_from_hf_config(
    config: PretrainedConfig | Mapping[str, Any] | ModelConfig, *, has_pooler: bool | None = None
) -> Arch:
    """Read an :class:`Arch` from a transformers config object, a parsed ``config.json`` (fields it omits
    take transformers' defaults) or a :class:`~vit_backbone.model_config.ModelConfig`.

    A full CLIP/SigLIP config contributes its ``vision_config``. Whether a ViT checkpoint has its pooler
    is not in the config (it is a constructor argument); it is inferred from ``architectures``
    (``ViTModel`` or none: yes; ``ViTForImageClassification`` / ``ViTForMaskedImageModeling``: no), and
    ``has_pooler`` overrides that inference.
    """
    cfg = config if isinstance(config, ModelConfig) else parse_config(_as_mapping(config))
    spec = cfg.spec
    if has_pooler and not spec.has_pooler_weights:
        raise InvalidOptionError(f"{spec.name} has no pooler; has_pooler=True applies to vit and siglip only")
    return Arch(
        family=spec.name,
        patch=cfg.patch_size,
        channels=cfg.channels,
        dim=cfg.dim,
        depth=cfg.depth,
        heads=cfg.heads,
        native_grid=cfg.native_grid,
        pos_embed=spec.pos_embed,
        cls_token=spec.has_cls,
        registers=cfg.num_registers,
        **spec.arch_fields(cfg, has_pooler),
    )


# --------------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------------


def _linear(fan_in: int, fan_out: int, bias: bool = True) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def count_params(arch: Arch) -> int:
    """Analytic parameter count of the vision backbone (see the module docstring for what is included)."""
    d = arch.dim
    ln = 2 * d  # a LayerNorm: weight and bias
    n_native = arch.native_grid[0] * arch.native_grid[1]
    total = _linear(arch.patch[0] * arch.patch[1] * arch.channels, d, arch.patch_bias)
    total += (int(arch.cls_token) + arch.registers + int(arch.mask_token)) * d
    if arch.pos_embed == "learned":
        total += (n_native + int(arch.cls_token)) * d
    if arch.pre_norm:
        total += ln

    q_bias, k_bias, v_bias = arch.qkv_bias
    block = 2 * ln  # the two pre-norms
    block += _linear(d, d, q_bias) + _linear(d, d, k_bias) + _linear(d, d, v_bias)
    block += _linear(d, d, arch.proj_bias)
    if arch.mlp_kind == "swiglu":
        block += 2 * _linear(d, arch.mlp_dim, arch.mlp_bias) + _linear(arch.mlp_dim, d, arch.mlp_bias)
    else:
        block += _linear(d, arch.mlp_dim, arch.mlp_bias) + _linear(arch.mlp_dim, d, arch.mlp_bias)
    if arch.layerscale:
        block += 2 * d
    total += arch.depth * block
    total += ln  # final norm (CLIP's post_layernorm)
    return total + _pooler_params(arch)


def _pooler_params(arch: Arch) -> int:
    if not arch.has_pooler:
        return 0
    d = arch.dim
    if spec_named(arch.family).pooler == "tanh":  # ViT: dense + tanh on CLS
        return _linear(d, arch.pooler_dim or d)
    # SigLIP multihead attention pooling: probe, packed in-proj, out-proj, norm, MLP
    return d + _linear(d, 3 * d) + _linear(d, d) + 2 * d + _linear(d, arch.mlp_dim) + _linear(arch.mlp_dim, d)


# --------------------------------------------------------------------------------------------------------
# Standard architectures (no weights needed)
# --------------------------------------------------------------------------------------------------------


def _vit(dim: int, depth: int, heads: int, patch: int) -> Arch:
    # Published ViT counts are backbone-only: no pooler (see the module docstring).
    return Arch("vit", (patch, patch), 3, dim, depth, heads, 4 * dim, (224 // patch, 224 // patch), "learned")


def _dinov2(dim: int, depth: int, heads: int, *, registers: int = 0, swiglu: bool = False) -> Arch:
    # Native 518 px = 37×37 at /14; giant uses SwiGLU with hidden = int(2/3·4·D) rounded up to 8 (4096).
    mlp = (int(4 * dim * 2 / 3) + 7) // 8 * 8 if swiglu else 4 * dim
    return Arch(
        "dinov2_registers" if registers else "dinov2",
        (14, 14),
        3,
        dim,
        depth,
        heads,
        mlp,
        (37, 37),
        "learned",
        registers=registers,
        mlp_kind="swiglu" if swiglu else "mlp",
        layerscale=True,
        mask_token=True,
    )


def _dinov3(dim: int, depth: int, heads: int) -> Arch:
    # As the facebook/dinov3-vit*16-pretrain-lvd1689m configs: RoPE, 4 registers, no key bias, image_size 224.
    return Arch(
        "dinov3",
        (16, 16),
        3,
        dim,
        depth,
        heads,
        4 * dim,
        (14, 14),
        "rope",
        registers=4,
        layerscale=True,
        mask_token=True,
        qkv_bias=(True, False, True),
    )


def _clip(dim: int, depth: int, heads: int, patch: int) -> Arch:
    return Arch(
        "clip",
        (patch, patch),
        3,
        dim,
        depth,
        heads,
        4 * dim,
        (224 // patch, 224 // patch),
        "learned",
        patch_bias=False,
        pre_norm=True,
    )


STANDARD_ARCHS: dict[str, Arch] = {
    "vit-s16": _vit(384, 12, 6, 16),
    "vit-b16": _vit(768, 12, 12, 16),
    "vit-b32": _vit(768, 12, 12, 32),
    "vit-l16": _vit(1024, 24, 16, 16),
    "vit-h14": _vit(1280, 32, 16, 14),
    "dinov2-s14": _dinov2(384, 12, 6),
    "dinov2-b14": _dinov2(768, 12, 12),
    "dinov2-l14": _dinov2(1024, 24, 16),
    "dinov2-g14": _dinov2(1536, 40, 24, swiglu=True),
    "dinov2-s14-reg": _dinov2(384, 12, 6, registers=4),
    "dinov2-b14-reg": _dinov2(768, 12, 12, registers=4),
    "dinov2-l14-reg": _dinov2(1024, 24, 16, registers=4),
    "dinov2-g14-reg": _dinov2(1536, 40, 24, registers=4, swiglu=True),
    "dinov3-s16": _dinov3(384, 12, 6),
    "dinov3-b16": _dinov3(768, 12, 12),
    "dinov3-l16": _dinov3(1024, 24, 16),
    "clip-b16": _clip(768, 12, 12, 16),
    "clip-b32": _clip(768, 12, 12, 32),
    "clip-l14": _clip(1024, 24, 16, 14),
    # SigLIP base/16 at 224: no CLS, the attention-pooling head is part of SiglipVisionModel.
    "siglip-b16": Arch(
        "siglip", (16, 16), 3, 768, 12, 12, 3072, (14, 14), "learned", cls_token=False, has_pooler=True
    ),
}
