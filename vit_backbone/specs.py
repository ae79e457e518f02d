"""One typed spec per backbone family: the one place that maps a ``model_type`` to a family.

Everything that differs between families lives here, so adding a family means adding a spec, not editing
branches across the library: which transformers class holds the vision tower, which ``model_type`` values it
answers to (and which of them nest the tower in ``vision_config``), transformers' config defaults, how many
prefix tokens come before the patches, how positions are encoded and resampled, which norm is "final", what
the model's own pooler is, the shape facts parameter and FLOP counts need, and the preprocessing a checkpoint
gets when it ships no processor config. Nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import InvalidOptionError, ModelLoadError, UnsupportedModelError
from .model_config import ModelConfig
from .preprocess_config import CLIP_MEAN, CLIP_STD, IMAGENET_MEAN, IMAGENET_STD

FamilyName = Literal["dinov2", "dinov2_registers", "dinov3", "vit", "clip", "siglip"]

PosEmbedKind = Literal["learned", "rope"]
# User-facing resampling rules for learned absolute position tables:
#   transformers: what transformers does for that family (the default, tested equal to it);
#   reference:    the DINOv2 reference code (bicubic, scale_factor=(n+0.1)/M, no antialias);
#   antialias:    timm's rule (bicubic to the target size with antialias).
InterpolationRule = Literal["transformers", "reference", "antialias"]
# The concrete resampling a rule resolves to for one family.
ResampleMethod = Literal["bicubic", "bicubic_antialias", "bicubic_offset"]
PoolerKind = Literal["tanh", "map", "norm_cls"]


@dataclass(frozen=True)
class FamilySpec:
    name: FamilyName  # the public name (README, info(), inspect)
    model_types: tuple[str, ...]  # config.json model_type values of this family
    dual_encoder_types: tuple[str, ...]  # of those, the ones whose config nests the tower in vision_config
    model_class: str  # transformers class that holds exactly the vision tower
    config_class: str  # transformers config class of the tower (config_defaults is held equal to it)
    config_defaults: Mapping[str, Any]  # the fields the library reads, as the config class defaults them
    arch_fields: Callable[[ModelConfig, bool | None], dict[str, Any]]  # family-specific Arch fields
    has_cls: bool
    pos_embed: PosEmbedKind
    transformers_resample: ResampleMethod  # what `interpolation="transformers"` means for this family
    final_norm: str  # attribute of the model applied to every token "through the final norm"
    pooler: PoolerKind  # what the model's own `pooler_output` is
    pos_table_attr: str  # attribute path of the learned table ("" for RoPE)
    pos_table_has_cls: bool  # whether row 0 of the table belongs to the CLS token
    needs_interpolate_flag: bool  # ViT/CLIP/SigLIP refuse non-native sizes unless asked
    default_processor: Mapping[str, Any]  # used only when a checkpoint has no preprocessor_config.json
    tower_prefix: str = "vision_model."  # the tower's weight names inside a dual-encoder checkpoint

    @property
    def default_pooling(self) -> Literal["cls", "pooler"]:
        """What ``embed`` pools when neither the caller nor the checkpoint says: CLS, or the model's own
        pooler for a family without CLS (SigLIP)."""
        return "cls" if self.has_cls else "pooler"

    @property
    def has_pooler_weights(self) -> bool:
        """Whether the model's own pooler has parameters (ViT's dense + tanh, SigLIP's attention head)."""
        return self.pooler in ("tanh", "map")

    def resample_method(self, rule: InterpolationRule) -> ResampleMethod:
        if self.pos_embed == "rope":
            if rule != "transformers":
                raise UnsupportedModelError(
                    f"{self.name} uses rotary position embeddings: there is no table to resample, "
                    f"so interpolation={rule!r} does not apply; leave interpolation unset"
                )
            return self.transformers_resample
        if rule == "transformers":
            return self.transformers_resample
        if rule == "reference":
            return "bicubic_offset"
        if rule == "antialias":
            return "bicubic_antialias"
        raise InvalidOptionError(
            f"interpolation must be one of 'transformers', 'reference', 'antialias'; got {rule!r}"
        )


# --------------------------------------------------------------------------------------------------------
# Family-specific shape facts for parameter and FLOP counts (vit_backbone.architectures builds the Arch)
# --------------------------------------------------------------------------------------------------------

# ViT heads built with add_pooling_layer=False (and, for masked image modeling, a mask token).
_VIT_WITHOUT_POOLER = ("ViTForImageClassification", "ViTForMaskedImageModeling")


def _vit_arch(cfg: ModelConfig, has_pooler: bool | None) -> dict[str, Any]:
    # Whether a ViT has its pooler is a constructor argument, not config: inferred from `architectures`.
    pooler = not any(name in _VIT_WITHOUT_POOLER for name in cfg.architectures)
    width = None if cfg.get("pooler_output_size") is None else cfg.positive_integer("pooler_output_size")
    return {
        "mlp_dim": cfg.positive_integer("intermediate_size"),
        "has_pooler": pooler if has_pooler is None else has_pooler,
        "pooler_dim": width if width != cfg.dim else None,
        "mask_token": "ViTForMaskedImageModeling" in cfg.architectures,
        "qkv_bias": (cfg.flag("qkv_bias"),) * 3,
    }


def _dinov2_arch(cfg: ModelConfig, has_pooler: bool | None) -> dict[str, Any]:
    hidden = int(cfg.dim * cfg.number("mlp_ratio"))
    swiglu = cfg.flag("use_swiglu_ffn")
    if swiglu:  # transformers' Dinov2SwiGLUFFN: 2/3 of the MLP width, rounded up to a multiple of 8
        hidden = (int(hidden * 2 / 3) + 7) // 8 * 8
    # Dinov2WithRegisters always has a mask token; Dinov2 only with use_mask_token.
    mask = cfg.flag("use_mask_token") if "use_mask_token" in cfg.spec.config_defaults else True
    return {
        "mlp_dim": hidden,
        "mlp_kind": "swiglu" if swiglu else "mlp",
        "layerscale": True,
        "mask_token": mask,
        "qkv_bias": (cfg.flag("qkv_bias"),) * 3,
    }


def _dinov3_arch(cfg: ModelConfig, has_pooler: bool | None) -> dict[str, Any]:
    return {
        "mlp_dim": cfg.positive_integer("intermediate_size"),
        "mlp_kind": "swiglu" if cfg.flag("use_gated_mlp") else "mlp",
        "layerscale": True,
        "mask_token": True,
        "qkv_bias": (cfg.flag("query_bias"), cfg.flag("key_bias"), cfg.flag("value_bias")),
        "proj_bias": cfg.flag("proj_bias"),
        "mlp_bias": cfg.flag("mlp_bias"),
    }


def _clip_arch(cfg: ModelConfig, has_pooler: bool | None) -> dict[str, Any]:
    # CLIP's patch convolution has no bias; a pre_layrnorm runs before the first block.
    return {"mlp_dim": cfg.positive_integer("intermediate_size"), "patch_bias": False, "pre_norm": True}


def _siglip_arch(cfg: ModelConfig, has_pooler: bool | None) -> dict[str, Any]:
    head = cfg.flag("vision_use_head") if has_pooler is None else has_pooler
    return {"mlp_dim": cfg.positive_integer("intermediate_size"), "has_pooler": head}


# --------------------------------------------------------------------------------------------------------
# transformers' config defaults (tests/vit_backbone/test_specs.py holds each table equal to its class)
# --------------------------------------------------------------------------------------------------------

_SHAPE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_channels": 3}
_DINOV2 = {**_SHAPE, "mlp_ratio": 4, "image_size": 224, "qkv_bias": True, "use_swiglu_ffn": False}
_DINOV3 = {
    **_SHAPE,
    "hidden_size": 384,
    "num_attention_heads": 6,
    "intermediate_size": 1536,
    "image_size": 224,
    "patch_size": 16,
    "query_bias": True,
    "key_bias": False,
    "value_bias": True,
    "proj_bias": True,
    "mlp_bias": True,
    "use_gated_mlp": False,
    "num_register_tokens": 0,
}
_MLP = {**_SHAPE, "intermediate_size": 3072, "image_size": 224}

_BIT = {
    "image_processor_type": "BitImageProcessor",
    "size": {"shortest_edge": 256},
    "crop_size": {"height": 224, "width": 224},
    "do_center_crop": True,
    "resample": 3,
    "image_mean": list(IMAGENET_MEAN),
    "image_std": list(IMAGENET_STD),
}

FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        name="dinov2",
        model_types=("dinov2",),
        dual_encoder_types=(),
        model_class="Dinov2Model",
        config_class="Dinov2Config",
        config_defaults={**_DINOV2, "patch_size": 14, "use_mask_token": True},
        arch_fields=_dinov2_arch,
        has_cls=True,
        pos_embed="learned",
        transformers_resample="bicubic",
        final_norm="layernorm",
        pooler="norm_cls",
        pos_table_attr="embeddings.position_embeddings",
        pos_table_has_cls=True,
        needs_interpolate_flag=False,
        default_processor=_BIT,
    ),
    FamilySpec(
        name="dinov2_registers",
        model_types=("dinov2_with_registers",),
        dual_encoder_types=(),
        model_class="Dinov2WithRegistersModel",
        config_class="Dinov2WithRegistersConfig",
        config_defaults={**_DINOV2, "patch_size": 16, "num_register_tokens": 4},
        arch_fields=_dinov2_arch,
        has_cls=True,
        pos_embed="learned",
        transformers_resample="bicubic_antialias",
        final_norm="layernorm",
        pooler="norm_cls",
        pos_table_attr="embeddings.position_embeddings",
        pos_table_has_cls=True,
        needs_interpolate_flag=False,
        default_processor=_BIT,
    ),
    FamilySpec(
        name="dinov3",
        model_types=("dinov3_vit",),
        dual_encoder_types=(),
        model_class="DINOv3ViTModel",
        config_class="DINOv3ViTConfig",
        config_defaults=_DINOV3,
        arch_fields=_dinov3_arch,
        has_cls=True,
        pos_embed="rope",
        transformers_resample="bicubic",
        final_norm="norm",
        pooler="norm_cls",
        pos_table_attr="",
        pos_table_has_cls=False,
        needs_interpolate_flag=False,
        default_processor={
            "image_processor_type": "DINOv3ViTImageProcessor",
            "size": {"height": 224, "width": 224},
            "do_center_crop": False,
            "resample": 2,
            "image_mean": list(IMAGENET_MEAN),
            "image_std": list(IMAGENET_STD),
        },
    ),
    FamilySpec(
        name="vit",
        model_types=("vit",),
        dual_encoder_types=(),
        model_class="ViTModel",
        config_class="ViTConfig",
        # pooler_output_size None: the width (transformers fills hidden_size in)
        config_defaults={**_MLP, "patch_size": 16, "qkv_bias": True, "pooler_output_size": None},
        arch_fields=_vit_arch,
        has_cls=True,
        pos_embed="learned",
        transformers_resample="bicubic",
        final_norm="layernorm",
        pooler="tanh",
        pos_table_attr="embeddings.position_embeddings",
        pos_table_has_cls=True,
        needs_interpolate_flag=True,
        default_processor={
            "image_processor_type": "ViTImageProcessor",
            "size": {"height": 224, "width": 224},
            "resample": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
    FamilySpec(
        name="clip",
        model_types=("clip", "clip_vision_model"),
        dual_encoder_types=("clip",),
        model_class="CLIPVisionModel",
        config_class="CLIPVisionConfig",
        config_defaults={**_MLP, "patch_size": 32},
        arch_fields=_clip_arch,
        has_cls=True,
        pos_embed="learned",
        transformers_resample="bicubic",
        final_norm="post_layernorm",
        pooler="norm_cls",
        pos_table_attr="embeddings.position_embedding.weight",
        pos_table_has_cls=True,
        needs_interpolate_flag=True,
        default_processor={
            "image_processor_type": "CLIPImageProcessor",
            "size": {"shortest_edge": 224},
            "crop_size": {"height": 224, "width": 224},
            "do_center_crop": True,
            "resample": 3,
            "image_mean": list(CLIP_MEAN),
            "image_std": list(CLIP_STD),
        },
    ),
    FamilySpec(
        name="siglip",
        model_types=("siglip", "siglip_vision_model"),
        dual_encoder_types=("siglip",),
        model_class="SiglipVisionModel",
        config_class="SiglipVisionConfig",
        config_defaults={**_MLP, "patch_size": 16, "vision_use_head": True},
        arch_fields=_siglip_arch,
        has_cls=False,
        pos_embed="learned",
        transformers_resample="bicubic",
        final_norm="post_layernorm",
        pooler="map",
        pos_table_attr="embeddings.position_embedding.weight",
        pos_table_has_cls=False,
        needs_interpolate_flag=True,
        default_processor={
            "image_processor_type": "SiglipImageProcessor",
            "size": {"height": 224, "width": 224},
            "resample": 3,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
    ),
)


FAMILY_NAMES: tuple[FamilyName, ...] = tuple(spec.name for spec in FAMILIES)
_BY_NAME: dict[str, FamilySpec] = {spec.name: spec for spec in FAMILIES}
_BY_MODEL_TYPE: dict[str, FamilySpec] = {t: spec for spec in FAMILIES for t in spec.model_types}


def spec_named(name: str) -> FamilySpec:
    """The spec of a public family name (``dinov2``, ``dinov2_registers``, ``dinov3``, ``vit``, ...)."""
    spec = _BY_NAME.get(name)
    if spec is None:
        raise InvalidOptionError(f"unknown family {name!r}; families: {', '.join(FAMILY_NAMES)}")
    return spec


def family_for(config: Mapping[str, Any], *, source: str = "config.json") -> FamilySpec:
    """The family of a ``config.json`` (or a transformers config's ``to_dict()``), by its ``model_type``."""
    model_type = config.get("model_type")
    if model_type is None:
        raise ModelLoadError(
            "field model_type is missing: it names the architecture (e.g. 'dinov2', 'clip')",
            path=source,
            field="model_type",
        )
    spec = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if spec is not None:
        return spec
    hint = ""
    if model_type == "siglip2":
        hint = (
            " (SigLIP2 NaFlex checkpoints are not supported; "
            "fixed-resolution SigLIP2 checkpoints use model_type 'siglip')"
        )
    known = ", ".join(_BY_MODEL_TYPE)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported ViT family{hint}; supported: {known}"
    )


def parse_config(config: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """The vision tower's config of a ``config.json`` mapping, with its family's transformers defaults filled
    in for every field it omits (a full CLIP/SigLIP config contributes its ``vision_config``)."""
    spec = family_for(config, source=source)
    tower: Mapping[str, Any] = config
    prefix = ""
    if config.get("model_type") in spec.dual_encoder_types:
        nested = config.get("vision_config")
        if nested is None:  # transformers builds the tower from its defaults
            nested = {}
        if not isinstance(nested, Mapping):
            raise ModelLoadError(
                f"field vision_config must be an object, got {type(nested).__name__}",
                path=source,
                field="vision_config",
            )
        tower, prefix = nested, "vision_config."
    return ModelConfig(spec, config, {**spec.config_defaults, **tower}, source, prefix).check()
