"""One typed spec per backbone family.

Everything that differs between families lives here, so adding a family means adding a spec, not editing
branches across the library: which transformers class holds the vision tower, how many prefix tokens come
before the patches, how positions are encoded and resampled, which norm is "final", what the model's own
pooler is, and the preprocessing a checkpoint gets when it ships no processor config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import InvalidOptionError, UnsupportedModelError
from .preprocess_config import CLIP_MEAN, CLIP_STD, IMAGENET_MEAN, IMAGENET_STD

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
    name: str
    model_types: tuple[str, ...]
    model_class: str  # transformers class that holds exactly the vision tower
    has_cls: bool
    pos_embed: PosEmbedKind
    transformers_resample: ResampleMethod  # what `interpolation="transformers"` means for this family
    final_norm: str  # attribute of the model applied to every token "through the final norm"
    pooler: PoolerKind  # what the model's own `pooler_output` is
    pos_table_attr: str  # attribute path of the learned table ("" for RoPE)
    pos_table_has_cls: bool  # whether row 0 of the table belongs to the CLS token
    needs_interpolate_flag: bool  # ViT/CLIP/SigLIP refuse non-native sizes unless asked
    default_processor: Mapping[str, Any]  # used only when a checkpoint has no preprocessor_config.json

    def vision_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """CLIP/SigLIP checkpoints may hold the whole dual encoder: take the vision tower's config."""
        if "vision_config" in config and config.get("model_type") in ("clip", "siglip", "siglip2"):
            vision = config["vision_config"]
            if not isinstance(vision, Mapping):
                raise UnsupportedModelError("config.json has a vision_config that is not an object")
            return vision
        return config

    def num_registers(self, config: Mapping[str, Any]) -> int:
        return int(self.vision_config(config).get("num_register_tokens", 0) or 0)

    def prefix_tokens(self, config: Mapping[str, Any]) -> int:
        return int(self.has_cls) + self.num_registers(config)

    def patch_size(self, config: Mapping[str, Any]) -> tuple[int, int]:
        return _pair(self.vision_config(config).get("patch_size", 16))

    def native_grid(self, config: Mapping[str, Any]) -> tuple[int, int]:
        vision = self.vision_config(config)
        size = _pair(vision.get("image_size", 224))
        patch = self.patch_size(config)
        return size[0] // patch[0], size[1] // patch[1]

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


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, list | tuple) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise UnsupportedModelError(f"expected an int or a pair of ints in config.json, got {value!r}")


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
        model_class="Dinov2Model",
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
        model_class="Dinov2WithRegistersModel",
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
        model_class="DINOv3ViTModel",
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
        model_class="ViTModel",
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
        model_class="CLIPVisionModel",
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
        model_class="SiglipVisionModel",
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


def family_for(config: Mapping[str, Any]) -> FamilySpec:
    model_type = config.get("model_type")
    for spec in FAMILIES:
        if model_type in spec.model_types:
            return spec
    known = ", ".join(t for spec in FAMILIES for t in spec.model_types)
    hint = ""
    if model_type == "siglip2":
        hint = (
            " (SigLIP2 NaFlex checkpoints are not supported; "
            "fixed-resolution SigLIP2 checkpoints use model_type 'siglip')"
        )
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported ViT family{hint}; supported: {known}"
    )
