"""Named, versioned defaults: what ``embed(images)`` does when no option is given.

A default that changes must not change the meaning of vectors already stored, so every default is a named
preset, reported with every result (``EmbedResult.preset``, the server's provenance, catalog, index and head
metadata), and the previous one stays available by name (``preset="default-v1"``). Catalogs, indexes and
heads store their resolved options (pooling, blocks, policy), so they keep serving whatever the default.

- ``default-v1``: the embedded backbone reads the mean of block 8 with ``pad``; every other checkpoint its
  family's token (CLS, or SigLIP's attention pooling) with ``crop``.
- ``default-v2``: the embedded backbone trims flat borders, then squashes (``trim_squash``: chosen on the
  harder copy-detection set, ``bench/copy_detection.py``), still the mean of block 8; a full CLIP/SigLIP
  checkpoint returns its projected image embedding (``projection``, the joint image-text space); others as v1.
- ``default-v3``: the embedded backbone trims borders and squashes into a 98x98 box (a 7x7 patch grid: a copy
  uploaded as a thumbnail and its full-size original then look alike, and a forward pass costs a fifth of
  224's), and reads CLS and patch mean of block 8 averaged over the image and its mirror image
  (``cls_mean_hflip``, 768 wide); chosen on the frozen copy-detection set (``bench/copy_detection.py``).
  Full CLIP/SigLIP checkpoints and the others as v2.

A checkpoint's own ``vitembed.json`` defaults (other than the embedded one) win over every preset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidOptionError

if TYPE_CHECKING:
    from .backbone_facts import EmbedDefaults

# No torch here (checkpoint resolution and `vitembed inspect` read these without it).


@dataclass(frozen=True)
class Preset:
    name: str
    pooling: str  # the embedded backbone's defaults: pooling, 0-based blocks, resize policy
    layers: tuple[int, ...]
    policy: str
    joint_space: bool  # a full CLIP/SigLIP checkpoint defaults to pooling="projection"
    size: tuple[int, int] | None = None  # the embedded backbone's box [h, w]; None: its native 224x224


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("default-v1", "mean", (8,), "pad", joint_space=False),
        Preset("default-v2", "mean", (8,), "trim_squash", joint_space=True),
        Preset("default-v3", "cls_mean_hflip", (8,), "trim_squash", joint_space=True, size=(98, 98)),
    )
}
DEFAULT_PRESET = "default-v3"
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def check_preset(name: str | None) -> str:
    """``name`` (None: the current default) as a known preset name, or InvalidOptionError naming them."""
    chosen = DEFAULT_PRESET if name is None else name
    if chosen not in PRESETS:
        raise InvalidOptionError(f"unknown preset {chosen!r}; choose one of {', '.join(PRESETS)}")
    return chosen


def embedded_defaults(name: str | None = None) -> dict[str, Any]:
    """The embedded backbone's defaults under a preset, as ``vitembed.json`` writes them."""
    p = PRESETS[check_preset(name)]
    size = None if p.size is None else list(p.size)
    return {"pooling": p.pooling, "layers": list(p.layers), "policy": p.policy, "size": size}


def resolve_presets(
    *,
    embedded: bool,
    family_pooling: str,
    has_projection: bool,
    declared: Mapping[str, Any] | None,
) -> dict[str, EmbedDefaults]:
    """Every preset's defaults for one checkpoint (each carrying its preset's name)."""
    from .backbone_facts import EmbedDefaults
    from .pooling import check_pooling
    from .preprocess import check_policy

    out: dict[str, EmbedDefaults] = {}
    for name, preset in PRESETS.items():
        if embedded:
            chosen = EmbedDefaults(
                check_pooling(preset.pooling), preset.layers, check_policy(preset.policy), size=preset.size
            )
        elif declared:
            layers = declared.get("layers")
            chosen = EmbedDefaults(
                pooling=check_pooling(str(declared.get("pooling", family_pooling))),
                layers=None if layers is None else tuple(int(i) for i in layers),
                policy=check_policy(str(declared.get("policy", "crop"))),
                size=_declared_size(declared.get("size")),
            )
        elif preset.joint_space and has_projection:
            chosen = EmbedDefaults("projection")
        else:
            chosen = EmbedDefaults(check_pooling(family_pooling))
        out[name] = dataclasses.replace(chosen, preset=name)
    return out


def _declared_size(raw: Any) -> tuple[int, int] | None:
    if raw is None:
        return None
    if not isinstance(raw, list | tuple) or len(raw) != 2 or not all(isinstance(v, int) for v in raw):
        raise InvalidOptionError(f"vitembed.json defaults.size must be [h, w] integers or null, got {raw!r}")
    return (int(raw[0]), int(raw[1]))
