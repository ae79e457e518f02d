"""A checkpoint's preprocessing, canonicalised and hashed.

:class:`PreprocessConfig` reads a ``preprocessor_config.json`` the way the checkpoint's transformers image
processor would (missing or null keys take that class's defaults), validates it, and reduces it to one
canonical form, so that two configs describing the same pipeline compare and hash equal. Applying it to an
image is :mod:`vit_backbone.preprocess`'s job.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from vit_backbone.errors import InvalidOptionError, UnsupportedModelError

ResizeMode = Literal["shortest_edge", "height_width"]

MAX_SIDE = 8192  # largest side, in pixels, of a configured or requested size (and of a dynamic output)

# Per-channel (R, G, B) normalisation statistics, as transformers names them in image_utils.
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # IMAGENET_DEFAULT_MEAN
IMAGENET_STD = (0.229, 0.224, 0.225)  # IMAGENET_DEFAULT_STD
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD

_CLIP = (CLIP_MEAN, CLIP_STD)
_IMAGENET_STANDARD = (IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)
_IMAGENET_DEFAULT = (IMAGENET_MEAN, IMAGENET_STD)
_HW224, _SE224 = {"height": 224, "width": 224}, {"shortest_edge": 224}


def _class_defaults(
    resample: int, stats: tuple[tuple[float, ...], ...], size: dict[str, int], square: bool, crop: bool
) -> dict[str, Any]:
    return {
        **{"do_resize": True, "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255},
        **{"resample": resample, "image_mean": stats[0], "image_std": stats[1], "size": size},
        **{"default_to_square": square, "crop_size": _HW224 if crop else None, "do_center_crop": crop},
    }


# The class attributes of each transformers processor (v5): what a missing or null key means.
_PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "BitImageProcessor": _class_defaults(3, _CLIP, _SE224, False, True),  # DINOv2 (+registers)
    "CLIPImageProcessor": _class_defaults(3, _CLIP, _SE224, False, True),
    "ViTImageProcessor": _class_defaults(2, _IMAGENET_STANDARD, _HW224, True, False),
    "SiglipImageProcessor": _class_defaults(3, _IMAGENET_STANDARD, _HW224, False, False),
    "DINOv3ViTImageProcessor": _class_defaults(2, _IMAGENET_DEFAULT, _HW224, True, False),
}
# DINOv3's processor rescales to float *before* a torchvision antialiased resize; the others resize uint8
# with PIL first. Its transformers class needs torchvision, which is not importable in this project's
# environment, so this parity cannot be tested here (the test skips without torchvision). Preprocessor's
# torch pipeline follows its `_preprocess` (rescale → tvF.resize(antialias=True) → center crop → normalize)
# with the same F.interpolate call tvF.resize makes for float tensors; a one-off check against
# transformers 5.24 + torchvision 0.28 in a throwaway environment gave a max abs diff of 0.0.
_TORCH_PIPELINE = frozenset({"DINOv3ViTImageProcessor"})
# PIL resample id → (interpolate mode, antialias), as transformers maps it for torchvision.
_TORCH_MODES: dict[int, tuple[str, bool]] = {
    0: ("nearest-exact", False),
    2: ("bilinear", True),
    3: ("bicubic", True),
}


@dataclass(frozen=True)
class PreprocessConfig:
    """A checkpoint's preprocessing, canonicalised so that equal pipelines hash equal."""

    processor_type: str  # canonical class name, e.g. "BitImageProcessor" (no Fast/Pil suffix)
    do_resize: bool
    resize_mode: ResizeMode
    shortest_edge: int | None  # set iff resize_mode == "shortest_edge"
    size: tuple[int, int] | None  # (H, W), set iff resize_mode == "height_width"
    do_center_crop: bool
    crop_size: tuple[int, int] | None  # (H, W), set iff do_center_crop
    resample: int  # PIL resampling id (0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming)
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    def __post_init__(self) -> None:
        if self.processor_type not in _PROCESSOR_DEFAULTS:
            raise UnsupportedModelError(_unsupported(self.processor_type))
        for name in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            v = getattr(self, name)
            _require(isinstance(v, bool), f"{name} must be a bool, got {v!r}")
        modes = get_args(ResizeMode)
        _require(self.resize_mode in modes, f"resize_mode must be one of {modes}, got {self.resize_mode!r}")
        if self.resize_mode == "shortest_edge":
            _check_hw("shortest_edge", (self.shortest_edge, self.shortest_edge), InvalidOptionError)
            _require(self.size is None, "resize_mode='shortest_edge' takes shortest_edge, not size")
        else:
            _check_hw("size", self.size, InvalidOptionError)
            _require(self.shortest_edge is None, "resize_mode='height_width' takes size, not shortest_edge")
        if self.do_center_crop:
            _check_hw("crop_size", self.crop_size, InvalidOptionError)
        _require(self.do_center_crop or self.crop_size is None, "crop_size needs do_center_crop=True")
        allowed = sorted(_TORCH_MODES) if self.pipeline == "torch" else list(range(6))
        ok = type(self.resample) is int and self.resample in allowed
        _require(ok, f"resample {self.resample!r} is not supported here; use one of {allowed}")
        ok = type(self.rescale_factor) is float and math.isfinite(self.rescale_factor)
        _require(ok, f"rescale_factor must be a finite float, got {self.rescale_factor!r}")
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            ok = isinstance(v, tuple) and len(v) == 3 and all(_finite(x) for x in v)
            _require(ok, f"{name} must be 3 finite floats (R, G, B), got {v!r}")
        _require(0 not in self.image_std, f"image_std must not contain 0, got {self.image_std}")

    @classmethod
    def from_processor_dict(
        cls, d: Mapping[str, Any], *, processor_type: str | None = None
    ) -> PreprocessConfig:
        """Read a ``preprocessor_config.json``; missing or null keys take the processor class's defaults,
        exactly as transformers' ``_set_attributes`` does."""
        raw = processor_type or d.get("image_processor_type") or d.get("feature_extractor_type")
        if not isinstance(raw, str):
            raise UnsupportedModelError(
                "the preprocessor config names no image_processor_type; pass processor_type= explicitly, "
                f"one of {sorted(_PROCESSOR_DEFAULTS)}"
            )
        ptype = raw.replace("FeatureExtractor", "ImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if ptype not in _PROCESSOR_DEFAULTS:
            raise UnsupportedModelError(_unsupported(raw))
        defaults = _PROCESSOR_DEFAULTS[ptype]

        def get(key: str) -> Any:
            value = d.get(key)
            return defaults[key] if value is None else value

        size = _size_dict("size", get("size"), square=bool(get("default_to_square")))
        if ptype == "CLIPImageProcessor" and d.get("use_square_size"):
            size = {"height": 224, "width": 224}  # transformers squares the *class* shortest_edge (KOSMOS-2)
        do_center_crop = _as_bool("do_center_crop", get("do_center_crop"))
        crop = _size_dict("crop_size", get("crop_size"), square=True) if do_center_crop else None
        if do_center_crop and crop is None:
            raise InvalidOptionError("do_center_crop is true but the config has no crop_size")
        shortest = "shortest_edge" in size
        return cls(
            processor_type=ptype,
            do_resize=_as_bool("do_resize", get("do_resize")),
            resize_mode="shortest_edge" if shortest else "height_width",
            shortest_edge=size["shortest_edge"] if shortest else None,
            size=None if shortest else (size["height"], size["width"]),
            do_center_crop=do_center_crop,
            crop_size=None if crop is None else (crop["height"], crop["width"]),
            resample=get("resample"),
            do_rescale=_as_bool("do_rescale", get("do_rescale")),
            rescale_factor=_triple("rescale_factor", get("rescale_factor"))[0],
            do_normalize=_as_bool("do_normalize", get("do_normalize")),
            image_mean=_triple("image_mean", get("image_mean")),
            image_std=_triple("image_std", get("image_std")),
        )

    @property
    def pipeline(self) -> Literal["pil", "torch"]:
        return "torch" if self.processor_type in _TORCH_PIPELINE else "pil"

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(H, W) the checkpoint's own pipeline always produces, or None if it depends on the image."""
        if self.do_center_crop:
            return self.crop_size
        return self.size if self.do_resize else None

    @property
    def default_box(self) -> tuple[int, int]:
        """(H, W) for squash/pad when no size is given: the checkpoint's output size, else its resize size."""
        se = self.shortest_edge or 0
        return self.output_size or self.size or (se, se)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def hash(self) -> str:
        """Provenance: first 16 hex digits of the sha256 of the canonical, key-sorted JSON."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_hw(
    name: str, value: Any, error: type[InvalidOptionError], limit: int = MAX_SIDE
) -> tuple[int, int]:
    ok = isinstance(value, tuple | list) and len(value) == 2
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit for v in value):
        raise error(f"{name} must be (H, W) with whole numbers in 1..{limit}, got {value!r}")
    return int(value[0]), int(value[1])


SizeArg = int | tuple[int, int]  # one number means a square: 256 is 256x256 (CLI, HTTP and library alike)
# ``size=NATIVE`` asks for the model's own box whatever the preset's: how stored options (a catalog's, an
# index's, a head card's ``size: null``, written when it meant the native box) are replayed
NATIVE: Literal["native"] = "native"
SizeChoice = SizeArg | Literal["native"]


def literal_size(stored: Sequence[int] | None) -> tuple[int, int] | Literal["native"]:
    """A stored size (catalog, index, head card) taken literally: null is the native box, never a preset's."""
    return NATIVE if stored is None else (int(stored[0]), int(stored[1]))


def square_size(size: SizeArg | None) -> tuple[int, int] | None:
    """``256`` -> ``(256, 256)``; an (H, W) pair or None is returned as it is (checked where it is used)."""
    if isinstance(size, bool) or not isinstance(size, int):
        return size  # type: ignore[return-value]  # (H, W), None, or a wrong value the size check refuses
    return (size, size)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidOptionError(message)


def _finite(value: Any) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise InvalidOptionError(f"{name} must be true or false in the preprocessor config, got {value!r}")


def _triple(name: str, value: Any) -> tuple[float, float, float]:
    values = [value] * 3 if _finite(value) else value
    if not isinstance(values, list | tuple) or len(values) != 3 or not all(_finite(v) for v in values):
        raise InvalidOptionError(f"{name} must be a number or 3 numbers (R, G, B), got {value!r}")
    return float(values[0]), float(values[1]), float(values[2])


def _size_dict(name: str, value: Any, *, square: bool) -> dict[str, int]:
    """transformers' get_size_dict: an int is a square (or a shortest edge when not ``square``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, list | tuple) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, Mapping):
        keys = {k for k, v in value.items() if v is not None}
        if keys in ({"shortest_edge"}, {"height", "width"}):
            return {k: value[k] for k in keys}
    raise InvalidOptionError(
        f"{name}={value!r} is not supported: expected an int, [H, W], {{'shortest_edge': n}} or "
        "{'height': h, 'width': w} (longest_edge / max_height style sizes are not implemented)"
    )


def _unsupported(name: str) -> str:
    return f"image processor {name!r} is not supported; supported: {', '.join(sorted(_PROCESSOR_DEFAULTS))}"


def nearest_multiples(value: int, step: int) -> str:
    """The multiples of ``step`` nearest to ``value`` (for messages): "224 or 240", or the smallest one."""
    below = value // step * step
    return f"{below} or {below + step}" if below > 0 else str(step)
