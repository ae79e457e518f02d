"""RGB image → normalised ``[3, H, W]`` tensor whose H and W are exact multiples of the patch.

The ``crop`` policy reproduces the checkpoint's own transformers image processor bit for bit (same
output-size rounding, same crop offsets, PIL resize on uint8, rescale in float64 then normalise in
float32), because embeddings are only comparable with published ones when the pixels are. The other
policies trade that parity for keeping more of the image. No policy drops remainder pixels silently:
a size that is not a multiple of the patch is an error naming the nearest valid sizes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from vit_backbone.borders import trim_borders
from vit_backbone.decode import DecodeLimits, decode, to_rgb
from vit_backbone.errors import ImageDecodeError, InvalidOptionError, SizeError
from vit_backbone.preprocess_config import (
    _TORCH_MODES,
    MAX_SIDE,
    PreprocessConfig,
    ResizeMode,
    _check_hw,
    nearest_multiples,
)

__all__ = [
    "MAX_SIDE",
    "Prepared",
    "PreprocessConfig",
    "Preprocessor",
    "ResizeMode",
    "ResizePolicy",
    "patch_coverage",
    "stack",
    "stack_valid",
]

ResizePolicy = Literal["crop", "squash", "pad", "dynamic", "trim_squash", "trim_pad"]
RESIZE_POLICIES: tuple[ResizePolicy, ...] = get_args(ResizePolicy)
TRIM_PREFIX = "trim_"  # trim_squash / trim_pad: flat borders cut away (vit_backbone.borders), then the policy


def base_policy(policy: str) -> str:
    """The resize a policy ends with: ``trim_pad`` → ``pad``."""
    return policy.removeprefix(TRIM_PREFIX)


def check_policy(policy: str) -> ResizePolicy:
    """``policy`` as a resize policy, or InvalidOptionError naming the choices."""
    if policy not in RESIZE_POLICIES:
        raise InvalidOptionError(f"unknown policy {policy!r}; choose one of {', '.join(RESIZE_POLICIES)}")
    return policy


@dataclass(frozen=True)
class Prepared:
    pixel_values: torch.Tensor  # [3, H, W] float32
    grid: tuple[int, int]  # (H / P_h, W / P_w), exact
    source_size: tuple[int, int]  # (H, W) of the full-resolution source (display orientation, pre-draft)
    policy: str
    decode_s: float = 0.0  # seconds spent decoding bytes (0 for an image given decoded); the rest is resizing
    # [h, w] float32: the fraction of each patch that holds image (pad's letterbox is 0); None = all image
    valid: np.ndarray | None = None
    # (top, left, height, width) in pixels of the image inside pad's letterbox; None = the whole tensor
    image_box: tuple[int, int, int, int] | None = None

    def validity(self) -> np.ndarray:
        """[h, w] float32 covered fraction of every patch (all ones without a letterbox)."""
        return np.ones(self.grid, dtype=np.float32) if self.valid is None else self.valid


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
    normalisation), the image starting on a patch boundary (centred to the nearest whole patch) and
    ``Prepared.valid`` telling which patches hold image; ``dynamic`` keeps the aspect ratio within a
    token budget and resizes straight to a patch-multiple size (no crop). The price: a small aspect
    distortion from snapping to whole patches,
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
        trim = policy.startswith(TRIM_PREFIX)
        if isinstance(image, bytes | bytearray | memoryview):
            img, source, decode_s = self._decode(bytes(image), policy, size, draft)
        elif isinstance(image, Image.Image):
            decode_s = 0.0
            plain_rgb = image.mode == "RGB" and "transparency" not in image.info
            img = image if plain_rgb else to_rgb(image, self.limits.background)
            source = (img.height, img.width)
            if min(source) <= 0:
                raise ImageDecodeError(
                    f"the image has a zero size ({img.width}x{img.height})", code="zero_size"
                )
            if trim:
                img = trim_borders(img)
        else:
            raise InvalidOptionError(f"expected a PIL.Image.Image or bytes, got {type(image).__name__}")
        plan = self._plan(policy, size, (img.height, img.width) if trim else source)
        pixels = self._run_torch(img, plan) if self.config.pipeline == "torch" else self._run_pil(img, plan)
        (ph, pw), (out_h, out_w) = self.patch_size, plan.out
        grid = (out_h // ph, out_w // pw)
        valid, box = None, _letterbox_box(policy, plan)
        if box is not None:
            valid = patch_coverage(grid, self.patch_size, (box[0], box[1]), (box[2], box[3]))
        return Prepared(
            pixel_values=pixels,
            grid=grid,
            source_size=source,
            policy=policy,
            decode_s=decode_s,
            valid=valid,
            image_box=box,
        )

    def _decode(
        self, data: bytes, policy: ResizePolicy, size: tuple[int, int] | None, draft: bool
    ) -> tuple[Image.Image, tuple[int, int], float]:
        """(the image, trimmed for ``trim_*``; the source's display (H, W); seconds decoding).

        A JPEG is drafted (decoded at 1/2, 1/4 or 1/8 in the DCT domain) down to the size the resize needs.
        A ``trim_*`` policy only knows that size once the border is cut away, so it drafts down to the box
        and keeps the draft when what is left after trimming still covers the resize; otherwise (a border
        larger than the draft's margin) it decodes again, at the scale the border asks for (full size if
        even that falls short), and trims that. A 1600x1200 photo then decodes and trims in ~8 ms instead
        of ~40 ms (embeddings within cosine 0.9999 of the full-size decode's; 0.997 where a border was
        trimmed at a smaller scale, its edge a pixel off: tests/vit_backbone/test_trim_draft.py)."""
        trim = policy.startswith(TRIM_PREFIX)

        def wanted(source_hw: tuple[int, int]) -> tuple[int, int] | None:
            if trim:
                box_h, box_w = size or self.config.default_box
                return box_w, box_h
            return self.min_decode_size(policy, size, source_hw)

        started = time.perf_counter()
        decoded = decode(data, limits=self.limits, min_size=wanted if draft else None)
        if not trim:
            return decoded.image, decoded.source_size, time.perf_counter() - started
        img = trim_borders(decoded.image)
        for attempt in range(2):  # at most: once at the scale the border asks for, once at full size
            resize = self._plan(policy, size, (img.height, img.width)).resize
            short = resize is not None and (img.height < resize[0] or img.width < resize[1])
            if decoded.draft_scale == 1 or not short or resize is None:
                break
            # the draft would be upsampled: decode again, scaled up by what the border took away
            need_w = math.ceil(decoded.image.width * resize[1] / img.width)
            need_h = math.ceil(decoded.image.height * resize[0] / img.height)
            decoded = decode(data, limits=self.limits, min_size=(need_w, need_h) if attempt == 0 else None)
            img = trim_borders(decoded.image)
        return img, decoded.source_size, time.perf_counter() - started

    def target_size(
        self, policy: ResizePolicy, size: tuple[int, int] | None, source_hw: tuple[int, int]
    ) -> tuple[int, int]:
        """(H, W) of the tensor this policy produces for a source of ``source_hw`` (H, W)."""
        self._check_request(policy, size)
        return self._plan(policy, size, _check_hw("source_hw", source_hw, InvalidOptionError, 1 << 20)).out

    def image_box(
        self, policy: ResizePolicy, size: tuple[int, int] | None, source_hw: tuple[int, int]
    ) -> tuple[int, int, int, int] | None:
        """(top, left, height, width) of a ``source_hw`` image inside ``pad``'s letterbox, as ``__call__``
        places it (None: the image fills the tensor), known before decoding: what maps per-pixel masks
        onto the grid and predicted masks back onto the image."""
        self._check_request(policy, size)
        return _letterbox_box(policy, self._plan(policy, size, source_hw))

    def min_decode_size(
        self, policy: ResizePolicy, size: tuple[int, int] | None, source_size: tuple[int, int]
    ) -> tuple[int, int] | None:
        """(min_w, min_h) — decode_image's convention — that a JPEG draft must not go below: the size the
        pipeline resizes to, so drafting only removes pixels the resize would discard. None: full size."""
        self._check_request(policy, size)
        plan = self._plan(policy, size, _check_hw("source_size", source_size, InvalidOptionError, 1 << 20))
        return None if plan.resize is None else (plan.resize[1], plan.resize[0])

    def _check_request(self, policy: str, size: tuple[int, int] | None) -> None:
        check_policy(policy)
        if size is not None:
            _check_hw("size", size, SizeError)

    def _plan(self, policy: str, size: tuple[int, int] | None, source_hw: tuple[int, int]) -> _Plan:
        cfg, (ph, pw) = self.config, self.patch_size
        requested, policy = policy, base_policy(policy)  # errors name the policy asked for (trim_squash)
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
                plan = _Plan(fit, None, box, _aligned_offset(box, fit, self.patch_size))
        _check_multiple(
            plan.out, self.patch_size, f"policy={requested!r}", size is not None, cfg.processor_type
        )
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

    def _finish(self, x: np.ndarray, plan: _Plan) -> torch.Tensor:
        """Letterbox (pad policy) with the mean colour in output units: exactly 0 when normalising.

        In numpy on purpose: these run on decode threads, and a torch op there would start an OpenMP
        team whose spinning workers steal the cores from the forward pass running at the same time."""
        if tuple(x.shape[-2:]) != plan.out:
            cfg = self.config
            scale = 0.0 if cfg.do_normalize else 255.0 * (cfg.rescale_factor if cfg.do_rescale else 1.0)
            fill = np.asarray([m * scale for m in cfg.image_mean], dtype=np.float32)[:, None, None]
            out = np.empty((3, *plan.out), dtype=np.float32)  # [3, H, W]
            out[...] = fill
            (top, left), (h, w) = plan.offset, x.shape[-2:]
            out[:, top : top + h, left : left + w] = x
            x = out
        return torch.from_numpy(np.ascontiguousarray(x))

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
        return self._finish(x, plan)

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
        return self._finish(x.numpy(), plan)


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


def stack_valid(prepared: Sequence[Prepared]) -> torch.Tensor | None:
    """``[B, h, w]`` covered fraction per patch for a batch ``stack`` accepts; None when no item is
    letterboxed (every patch is image), so unpadded batches pay nothing."""
    if all(p.valid is None for p in prepared):
        return None
    return torch.from_numpy(np.stack([p.validity() for p in prepared]))  # [B, h, w] float32


def patch_coverage(
    grid: tuple[int, int], patch: tuple[int, int], offset: tuple[int, int], image_hw: tuple[int, int]
) -> np.ndarray:
    """[h, w] float32 fraction of each patch's pixels covered by an ``image_hw`` image placed at ``offset``
    (top, left) on a ``grid`` of ``patch``-sized cells: 1 inside, 0 on the letterbox, partial on the edge."""

    def axis(cells: int, size: int, start: int, length: int) -> np.ndarray:
        lo = np.arange(cells) * size  # [cells]
        covered = np.minimum(lo + size, start + length) - np.maximum(lo, start)
        return np.clip(covered, 0, size).astype(np.float32) / size

    rows = axis(grid[0], patch[0], offset[0], image_hw[0])  # [h]
    cols = axis(grid[1], patch[1], offset[1], image_hw[1])  # [w]
    return np.outer(rows, cols).astype(np.float32)  # [h, w]


def _letterbox_box(policy: str, plan: _Plan) -> tuple[int, int, int, int] | None:
    if base_policy(policy) != "pad" or plan.resize is None or plan.resize == plan.out:
        return None
    return (*plan.offset, *plan.resize)


def _aligned_offset(box: tuple[int, int], fit: tuple[int, int], patch: tuple[int, int]) -> tuple[int, int]:
    """(top, left) of a letterboxed image: centred to the nearest whole patch, so the image is cut into
    the same patches whatever the box around it (its last row/column of patches may be partly letterbox)."""
    return tuple(  # type: ignore[return-value]
        (b // p - -(-f // p)) // 2 * p for b, f, p in zip(box, fit, patch, strict=True)
    )


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
        f"{name} {v} (nearest multiples of {p}: {nearest_multiples(v, p)})"
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


def check_token_budget(
    grid: tuple[int, int], limit: int, what: str, advice: str = "ask for a smaller size"
) -> int:
    """The patch tokens of ``grid``, or SizeError when they pass ``limit`` (attention cost grows with
    tokens²); ``what`` names where the grid came from, e.g. "size 224x224"."""
    tokens = grid[0] * grid[1]
    if tokens > limit:
        raise SizeError(
            f"{what} gives {tokens} patch tokens, over the server's limit of {limit} "
            f"(attention cost grows with tokens²); {advice}"
        )
    return tokens


def batches_by_grid(prepared: Sequence[Prepared], batch_size: int) -> Iterator[list[int]]:
    """Indices of ``prepared`` in batches of one grid each (one forward pass per batch), input order kept
    within a grid."""
    groups: dict[tuple[int, int], list[int]] = {}
    for index, item in enumerate(prepared):
        groups.setdefault(item.grid, []).append(index)
    for indices in groups.values():
        for start in range(0, len(indices), batch_size):
            yield indices[start : start + batch_size]
