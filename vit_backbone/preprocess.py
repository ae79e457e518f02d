"""RGB image → normalised ``[3, H, W]`` tensor whose H and W are exact multiples of the patch.

The ``crop`` policy reproduces the checkpoint's own transformers image processor bit for bit (same
output-size rounding, same crop offsets, PIL resize on uint8, rescale in float64 then normalise in
float32), because embeddings are only comparable with published ones when the pixels are. The other
policies trade that parity for keeping more of the image. No policy drops remainder pixels silently:
a size that is not a multiple of the patch is an error naming the nearest valid sizes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vit_backbone.decode import DecodeLimits, decode, to_rgb
from vit_backbone.errors import ImageDecodeError, InvalidOptionError, SizeError, UnsupportedModelError

ResizePolicy = Literal["crop", "squash", "pad", "dynamic"]
ResizeMode = Literal["shortest_edge", "height_width"]

MAX_SIDE = 8192
_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
_IMAGENET_STANDARD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
_IMAGENET_DEFAULT = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
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
# environment, so this parity cannot be tested here (the test skips without torchvision). The code follows
# its `_preprocess` (rescale → tvF.resize(antialias=True) → center crop → normalize) with the same
# F.interpolate call tvF.resize makes for float tensors; a one-off check against transformers 5.24 +
# torchvision 0.28 in a throwaway environment gave a max abs diff of 0.0.
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


@dataclass(frozen=True)
class Prepared:
    pixel_values: torch.Tensor  # [3, H, W] float32
    grid: tuple[int, int]  # (H / P_h, W / P_w), exact
    source_size: tuple[int, int]  # (H, W) of the full-resolution source (display orientation, pre-draft)
    policy: str


@dataclass(frozen=True)
class _Plan:
    resize: tuple[int, int] | None  # (H, W) the whole image is resized to
    crop: tuple[int, int] | None  # (H, W) center crop after the resize
    out: tuple[int, int]  # (H, W) of the final tensor
    offset: tuple[int, int] = (0, 0)  # (top, left) of the image inside `out` (pad only)


class Preprocessor:
    """Turns an image (or untrusted bytes) into a tensor on a grid the backbone can take.

    Policies: ``crop`` is the checkpoint's own pipeline (or, with ``size``, the same pipeline scaled:
    shortest-edge resize by the checkpoint's resize/crop ratio, then center crop); ``squash`` resizes
    to exactly (H, W); ``pad`` fits inside (H, W) and letterboxes with the mean colour (0 after
    normalisation); ``dynamic`` keeps the aspect ratio within a token budget and resizes straight to a
    patch-multiple size (no crop). The price: a small aspect distortion from snapping to whole patches,
    and images smaller than the budget are upsampled, so that token counts stay predictable.
    """

    def __init__(
        self,
        config: PreprocessConfig,
        patch_size: tuple[int, int],
        native_grid: tuple[int, int],
        *,
        limits: DecodeLimits | None = None,
    ) -> None:
        self.config = config
        self.patch_size = _check_hw("patch_size", patch_size, InvalidOptionError)
        self.native_grid = _check_hw("native_grid", native_grid, InvalidOptionError)
        self.limits = limits or DecodeLimits()

    def __call__(
        self,
        image: Image.Image | bytes,
        *,
        policy: ResizePolicy = "crop",
        size: tuple[int, int] | None = None,
        draft: bool = True,
    ) -> Prepared:
        self._check_request(policy, size)
        if isinstance(image, bytes | bytearray | memoryview):

            def wanted(source_hw: tuple[int, int]) -> tuple[int, int] | None:
                return self.min_decode_size(policy, size, source_hw)

            decoded = decode(bytes(image), limits=self.limits, min_size=wanted if draft else None)
            img, source = decoded.image, decoded.source_size
        elif isinstance(image, Image.Image):
            plain_rgb = image.mode == "RGB" and "transparency" not in image.info
            img = image if plain_rgb else to_rgb(image, self.limits.background)
            source = (img.height, img.width)
            if min(source) <= 0:
                raise ImageDecodeError(
                    f"the image has a zero size ({img.width}x{img.height})", code="zero_size"
                )
        else:
            raise InvalidOptionError(f"expected a PIL.Image.Image or bytes, got {type(image).__name__}")
        plan = self._plan(policy, size, source)
        pixels = self._run_torch(img, plan) if self.config.pipeline == "torch" else self._run_pil(img, plan)
        (ph, pw), (out_h, out_w) = self.patch_size, plan.out
        return Prepared(
            pixel_values=pixels, grid=(out_h // ph, out_w // pw), source_size=source, policy=policy
        )

    def target_size(
        self, policy: ResizePolicy, size: tuple[int, int] | None, source_hw: tuple[int, int]
    ) -> tuple[int, int]:
        """(H, W) of the tensor this policy produces for a source of ``source_hw`` (H, W)."""
        self._check_request(policy, size)
        return self._plan(policy, size, _check_hw("source_hw", source_hw, InvalidOptionError, 1 << 20)).out

    def min_decode_size(
        self, policy: ResizePolicy, size: tuple[int, int] | None, source_size: tuple[int, int]
    ) -> tuple[int, int] | None:
        """(min_w, min_h) — decode_image's convention — that a JPEG draft must not go below: the size the
        pipeline resizes to, so drafting only removes pixels the resize would discard. None: full size."""
        self._check_request(policy, size)
        plan = self._plan(policy, size, _check_hw("source_size", source_size, InvalidOptionError, 1 << 20))
        return None if plan.resize is None else (plan.resize[1], plan.resize[0])

    def _check_request(self, policy: str, size: tuple[int, int] | None) -> None:
        if policy not in get_args(ResizePolicy):
            raise InvalidOptionError(f"policy must be one of {get_args(ResizePolicy)}, got {policy!r}")
        if size is not None:
            _check_hw("size", size, SizeError)

    def _plan(self, policy: str, size: tuple[int, int] | None, source_hw: tuple[int, int]) -> _Plan:
        cfg, (ph, pw) = self.config, self.patch_size
        if policy == "dynamic":
            budget = math.prod(self.native_grid) if size is None else (size[0] // ph) * (size[1] // pw)
            if budget < 1:
                raise SizeError(f"size {size} holds no whole {ph}x{pw} patch; give at least {ph}x{pw}")
            gh, gw = _dynamic_grid(source_hw, self.patch_size, budget)
            return _Plan(resize=(gh * ph, gw * pw), crop=None, out=(gh * ph, gw * pw))
        if policy == "crop":
            plan = self._crop_plan(size, source_hw)
        else:
            box = size or cfg.default_box
            if policy == "squash":
                plan = _Plan(resize=box, crop=None, out=box)
            else:
                fit = _fit_inside(source_hw, box)
                plan = _Plan(fit, None, box, ((box[0] - fit[0]) // 2, (box[1] - fit[1]) // 2))
        _check_multiple(plan.out, self.patch_size, f"policy={policy!r}", size is not None, cfg.processor_type)
        return plan

    def _crop_plan(self, size: tuple[int, int] | None, source_hw: tuple[int, int]) -> _Plan:
        cfg = self.config
        if size is None:
            resize = None
            if cfg.do_resize:
                se = cfg.shortest_edge
                resize = _cover(source_hw, (se, se)) if se is not None else cfg.size
            return _Plan(resize, cfg.crop_size, cfg.crop_size or resize or source_hw)
        if not cfg.do_center_crop or cfg.crop_size is None:
            return _Plan(resize=size, crop=None, out=size)
        if not cfg.do_resize:
            return _Plan(resize=None, crop=size, out=size)
        (h, w), (ch, cw) = size, cfg.crop_size
        if cfg.shortest_edge is not None:  # cover a box scaled by the checkpoint's resize/crop ratio
            se = cfg.shortest_edge
            box = ((2 * h * se + ch) // (2 * ch), (2 * w * se + cw) // (2 * cw))
            return _Plan(resize=_cover(source_hw, box), crop=size, out=size)
        sh, sw = cfg.size or (ch, cw)
        return _Plan(
            resize=((2 * h * sh + ch) // (2 * ch), (2 * w * sw + cw) // (2 * cw)), crop=size, out=size
        )

    def _finish(self, x: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Letterbox (pad policy) with the mean colour in output units: exactly 0 when normalising."""
        if tuple(x.shape[-2:]) == plan.out:
            return x.contiguous()
        cfg = self.config
        scale = 0.0 if cfg.do_normalize else 255.0 * (cfg.rescale_factor if cfg.do_rescale else 1.0)
        fill = torch.tensor([m * scale for m in cfg.image_mean], dtype=torch.float32).view(3, 1, 1)
        out = fill.expand(3, *plan.out).clone()  # [3, H, W]
        (top, left), (h, w) = plan.offset, x.shape[-2:]
        out[:, top : top + h, left : left + w] = x
        return out

    def _run_pil(self, img: Image.Image, plan: _Plan) -> torch.Tensor:
        """transformers' PilBackend: PIL resize on uint8, numpy crop, float64 rescale, float32 normalise."""
        cfg = self.config
        if plan.resize is not None:
            img = img.resize((plan.resize[1], plan.resize[0]), resample=cfg.resample)
        arr = np.asarray(img).transpose(2, 0, 1)  # [3, H, W] uint8
        if plan.crop is not None:
            arr = _np_center_crop(arr, plan.crop)
        if cfg.do_rescale:
            x = (arr.astype(np.float64) * cfg.rescale_factor).astype(np.float32)  # [3, H, W]
        else:
            x = arr.astype(np.float32)
        if cfg.do_normalize:  # float32 (x - mean) / std, as transformers' normalize()
            mean, std = (np.asarray(v, np.float32)[:, None, None] for v in (cfg.image_mean, cfg.image_std))
            x = (x - mean) / std
        return self._finish(torch.from_numpy(np.ascontiguousarray(x)), plan)

    def _run_torch(self, img: Image.Image, plan: _Plan) -> torch.Tensor:
        """DINOv3's order: rescale to float32, antialiased float resize, torchvision crop, normalise."""
        cfg = self.config
        t = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
        x = t * cfg.rescale_factor if cfg.do_rescale else t.to(torch.float32)  # [3, H, W] float32
        if plan.resize is not None and tuple(x.shape[-2:]) != plan.resize:
            mode, aa = _TORCH_MODES[cfg.resample]  # align_corners=False exactly where antialias applies
            x = F.interpolate(
                x[None], plan.resize, mode=mode, align_corners=False if aa else None, antialias=aa
            )
            x = x[0]
        if plan.crop is not None:
            x = _tv_center_crop(x, plan.crop)
        if cfg.do_normalize:
            mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(3, 1, 1)
            x = x.sub(mean).div_(torch.tensor(cfg.image_std, dtype=torch.float32).view(3, 1, 1))
        return self._finish(x, plan)


def stack(prepared: Sequence[Prepared]) -> tuple[torch.Tensor, tuple[int, int]]:
    """Batch items that share a grid into ``[B, 3, H, W]``; mixed grids must be batched separately."""
    if not prepared:
        raise InvalidOptionError("stack() needs at least one prepared image")
    shapes = {(p.grid, tuple(p.pixel_values.shape)) for p in prepared}
    if len(shapes) > 1:
        raise InvalidOptionError(
            f"cannot stack images with different grids/shapes {sorted(shapes)}; group them by grid, or use "
            "a policy with a fixed size (crop, squash, pad) or dynamic with the same size"
        )
    return torch.stack([p.pixel_values for p in prepared]), prepared[0].grid  # [B, 3, H, W]


def _cover(source_hw: tuple[int, int], box: tuple[int, int]) -> tuple[int, int]:
    """Smallest aspect-preserving size covering ``box``; for a square box this is exactly transformers'
    ``get_resize_output_image_size(default_to_square=False)``: the long side is ``int(s * long / short)``."""
    (h, w), (bh, bw) = source_hw, box
    return (bh, int(bh * w / h)) if w * bh >= h * bw else (int(bw * h / w), bw)


def _fit_inside(source_hw: tuple[int, int], box: tuple[int, int]) -> tuple[int, int]:
    """Largest aspect-preserving size inside ``box`` (the free side rounded half-up, at least 1 px)."""
    (h, w), (bh, bw) = source_hw, box
    if h * bw >= w * bh:
        return bh, max(1, min(bw, (2 * w * bh + h) // (2 * h)))
    return max(1, min(bh, (2 * h * bw + w) // (2 * w))), bw


def _dynamic_grid(source_hw: tuple[int, int], patch: tuple[int, int], budget: int) -> tuple[int, int]:
    """(rows, cols) with rows * cols <= budget, minimising aspect distortion + unused budget (both as
    |log ratio|, so 10% of either costs the same). Rounding each side of the ideal continuous grid on its
    own fails for thin images (1.9 rows → 1 doubles the aspect), hence the small exhaustive search."""
    (h, w), (ph, pw) = source_hw, patch
    aspect = (h / ph) / (w / pw)  # rows per column
    best = (math.inf, math.inf, 0, 1, 1)  # (cost, distortion, -tokens, rows, cols); 1x1 always fits
    for r in range(1, min(budget, MAX_SIDE // ph) + 1):
        cap = min(budget // r, MAX_SIDE // pw)
        for c in {min(max(math.floor(r / aspect), 1), cap), min(max(math.ceil(r / aspect), 1), cap)}:
            distortion = abs(math.log(r / c / aspect))
            key = (distortion + math.log(budget / (r * c)), distortion, -r * c, r, c)
            best = min(best, key)
    return best[3], best[4]


def _np_center_crop(arr: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """transformers.image_transforms.center_crop on [C, H, W], including its zero padding (ceil-centred)."""
    (height, width), (ch, cw) = arr.shape[-2:], crop
    top, left = (height - ch) // 2, (width - cw) // 2
    if top >= 0 and left >= 0:
        return arr[:, top : top + ch, left : left + cw]
    new_h, new_w = max(ch, height), max(cw, width)
    canvas = np.zeros((arr.shape[0], new_h, new_w), dtype=arr.dtype)  # [C, H', W']
    top_pad, left_pad = (new_h - height + 1) // 2, (new_w - width + 1) // 2
    canvas[:, top_pad : top_pad + height, left_pad : left_pad + width] = arr
    top, left = top + top_pad, left + left_pad
    return canvas[:, max(0, top) : min(new_h, top + ch), max(0, left) : min(new_w, left + cw)]


def _tv_center_crop(x: torch.Tensor, crop: tuple[int, int]) -> torch.Tensor:
    """transformers' TorchvisionBackend.center_crop, whose padding is floor-centred (unlike numpy's)."""
    (height, width), (ch, cw) = x.shape[-2:], crop
    if cw > width or ch > height:
        dw, dh = max(cw - width, 0), max(ch - height, 0)
        x = F.pad(x, (dw // 2, (dw + 1) // 2, dh // 2, (dh + 1) // 2), value=0.0)
        height, width = x.shape[-2:]
    top, left = int((height - ch) / 2.0), int((width - cw) / 2.0)
    return x[..., top : top + ch, left : left + cw]


def _check_multiple(out: tuple[int, int], patch: tuple[int, int], what: str, given: bool, ptype: str) -> None:
    problems = [
        f"{name} {v} (nearest multiples of {p}: {_nearest(v, p)})"
        for name, v, p in (("height", out[0], patch[0]), ("width", out[1], patch[1]))
        if v % p
    ]
    if problems:
        origin = "the requested size" if given else f"the {ptype} checkpoint's size"
        raise SizeError(
            f"{what}: {origin} {out[0]}x{out[1]} is not a multiple of the {patch[0]}x{patch[1]} patch: "
            f'{"; ".join(problems)}. Pass size= with multiples of the patch, or use policy="dynamic", '
            "which snaps to the patch grid (remainder pixels are never cropped silently)."
        )


def _nearest(value: int, patch: int) -> str:
    low = value // patch * patch
    return f"{low} or {low + patch}" if low else str(patch)


def _check_hw(
    name: str, value: Any, error: type[InvalidOptionError], limit: int = MAX_SIDE
) -> tuple[int, int]:
    ok = isinstance(value, tuple | list) and len(value) == 2
    if not ok or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit for v in value):
        raise error(f"{name} must be (H, W) with whole numbers in 1..{limit}, got {value!r}")
    return int(value[0]), int(value[1])


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
