"""Pictures of patch tokens: the PCA map, patch-to-patch cosines, and the pixels the model was given.

``patch_pca`` is DINOv2's well-known picture: the first three principal components of an image's patch
tokens, each scaled to [0, 1] and shown as RGB. With ``background_threshold`` the first component of all
patches separates foreground from background first (patches whose min-max scaled first component exceeds
the threshold are kept), and the three components are then computed on the kept patches only, the others
shown black. With ``valid`` (a pad letterbox's ``Prepared.valid``: the image fraction of each patch), only
the patches that hold image take part: the letterbox is tokens spent on nothing, and letting it into the
components would spend a colour on it; those patches are shown black too.

Sign conventions (a principal direction's sign is arbitrary; these make it a function of the data, so a
direction gets the same colour in every image that has it):

* every component is oriented so that its largest-magnitude loading (the feature channel that weighs most)
  is positive (scikit-learn's ``svd_flip`` rule on the components);
* the first component used for background removal is then oriented so that the patches on the image's
  border (the outer ring of the patches that hold image) have the lower mean (the border is background
  far more often than not), so "foreground" is the high side whatever the loadings say.

``patch_similarity`` is dense correspondence: the cosine of one query patch token with every patch token of
another image. ``model_view`` undoes the processor's rescale and normalisation so a person sees the pixels
the model saw (crop, squash, letterbox or dynamic resize).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidOptionError
from .preprocess_config import PreprocessConfig

__all__ = ["PcaMap", "model_view", "patch_pca", "patch_similarity"]

PCA_COMPONENTS = 3
_EPS = 1e-12


@dataclass(frozen=True)
class PcaMap:
    rgb: np.ndarray  # [h, w, 3] float32 in [0, 1]; background patches 0
    first: np.ndarray  # [h, w] float32 in [0, 1]: first component of the image's patches, border side low
    foreground: np.ndarray  # [h, w] bool: patches kept (all that hold image without a threshold)
    explained: tuple[float, ...]  # variance share of each of the 3 components (of the patches they used)
    threshold: float | None


def _check_grid(tokens: np.ndarray, what: str) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 3 or min(array.shape) < 1:
        raise InvalidOptionError(f"{what} must be a patch grid [h, w, D], got shape {list(array.shape)}")
    if not np.isfinite(array).all():
        raise InvalidOptionError(f"{what} holds non-finite values")
    return array.astype(np.float64)


def _components(x: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Principal directions of rows ``x`` [n, D]: (mean [D], components [count, D], explained [count]).
    Missing directions (fewer rows than ``count``, or rank-deficient data) are zero rows."""
    mean = x.mean(axis=0)  # [D]
    centred = x - mean  # [n, D]
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)  # vt: [min(n, D), D]
    variance = singular**2
    total = float(variance.sum())
    components = np.zeros((count, x.shape[1]))
    explained = np.zeros(count)
    for i in range(min(count, vt.shape[0])):
        if total <= _EPS or variance[i] <= total * 1e-12:
            break
        v = vt[i]
        components[i] = v if v[np.argmax(np.abs(v))] > 0 else -v
        explained[i] = variance[i] / total
    return mean, components, explained


def _unit_scale(values: np.ndarray) -> np.ndarray:
    """Min-max to [0, 1] per column; a constant column is 0."""
    low, high = values.min(axis=0), values.max(axis=0)
    span = high - low
    return np.where(span > _EPS, (values - low) / np.where(span > _EPS, span, 1.0), 0.0)


def _image_patches(valid: np.ndarray | None, h: int, w: int) -> np.ndarray:
    """[h, w] bool: the patches that hold any image (all of them without ``valid``)."""
    if valid is None:
        return np.ones((h, w), dtype=bool)
    coverage = np.asarray(valid)
    if coverage.shape != (h, w):
        raise InvalidOptionError(f"valid must be the patch grid's shape {[h, w]}, got {list(coverage.shape)}")
    holds = coverage > 0
    if not holds.any():
        raise InvalidOptionError("no patch holds image (valid is all zero)")
    return holds


def _ring(holds: np.ndarray) -> np.ndarray:
    """[h, w] bool: the outer ring of the bounding box of the patches that hold image."""
    rows, cols = np.nonzero(holds)
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    ring = np.zeros_like(holds)
    ring[top : bottom + 1, left : right + 1] = True
    if bottom - top > 1 and right - left > 1:
        ring[top + 1 : bottom, left + 1 : right] = False
    return ring & holds


def patch_pca(
    patches: np.ndarray,
    *,
    background_threshold: float | None = None,
    components: int = PCA_COMPONENTS,
    valid: np.ndarray | None = None,
) -> PcaMap:
    """The PCA map of one image's patch tokens ``patches`` [h, w, D]; ``valid`` [h, w]: the image fraction
    of each patch (patches without image are left out and shown black). See the module docstring."""
    grid = _check_grid(patches, "patches")
    if background_threshold is not None and not 0.0 <= background_threshold <= 1.0:
        raise InvalidOptionError(f"background_threshold must be in [0, 1], got {background_threshold}")
    h, w, dim = grid.shape
    holds = _image_patches(valid, h, w)  # [h, w]
    x = grid.reshape(h * w, dim)  # [N, D]
    image_rows = holds.reshape(-1)
    mean, basis, explained = _components(x[image_rows], components)
    first = ((x - mean) @ basis[0]).reshape(h, w)  # [h, w]
    if first[_ring(holds)].mean() > first[holds].mean():
        first = -first
    first01 = np.zeros((h, w))
    first01[holds] = _unit_scale(first[holds].reshape(-1, 1))[:, 0]
    keep = holds
    if background_threshold is not None:
        keep = holds & (first01 > background_threshold)
        kept = x[keep.reshape(-1)]  # [n_fg, D]
        if len(kept) >= 2:
            mean, basis, explained = _components(kept, components)
        else:
            basis, explained = np.zeros_like(basis), np.zeros_like(explained)
    rgb = np.zeros((h * w, components))
    rows = keep.reshape(-1)
    if rows.any():
        projected = (x[rows] - mean) @ basis.T  # [n_kept, components]
        scaled = _unit_scale(projected)
        scaled[:, ~np.any(basis, axis=1)] = 0.0  # directions that do not exist stay black
        rgb[rows] = scaled
    return PcaMap(
        rgb=rgb.reshape(h, w, components).astype(np.float32),
        first=first01.astype(np.float32),
        foreground=keep,
        explained=tuple(float(e) for e in explained),
        threshold=background_threshold,
    )


def patch_similarity(query: np.ndarray, row: int, col: int, target: np.ndarray) -> np.ndarray:
    """Cosine of the query's patch (row, col) with every patch of ``target``: [h2, w2] float32 in [-1, 1]."""
    q = _check_grid(query, "query patches")
    t = _check_grid(target, "target patches")
    h, w, dim = q.shape
    if t.shape[2] != dim:
        raise InvalidOptionError(f"query patches are {dim}-wide and target patches {t.shape[2]}-wide")
    for name, value, limit in (("row", row, h), ("col", col, w)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < limit:
            raise InvalidOptionError(f"patch {name} must be in 0..{limit - 1} (the query grid is {h}x{w})")
    vector = q[row, col]  # [D]
    vector = vector / max(float(np.linalg.norm(vector)), _EPS)
    norms = np.maximum(np.linalg.norm(t, axis=-1), _EPS)  # [h2, w2]
    return ((t @ vector) / norms).astype(np.float32)  # [h2, w2]


def model_view(pixel_values: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """The processor's output ``pixel_values`` [3, H, W] back to 8-bit RGB [H, W, 3]: normalisation and
    rescaling undone, so the letterbox of ``pad`` shows as the mean colour it is."""
    x = np.asarray(pixel_values, dtype=np.float64)  # [3, H, W]
    if x.ndim != 3 or x.shape[0] != 3:
        raise InvalidOptionError(f"pixel_values must be [3, H, W], got {list(x.shape)}")
    if config.do_normalize:
        std = np.asarray(config.image_std, dtype=np.float64)[:, None, None]
        x = x * std + np.asarray(config.image_mean, dtype=np.float64)[:, None, None]
    if config.do_rescale:
        x = x / config.rescale_factor
    return np.clip(np.rint(x), 0, 255).astype(np.uint8).transpose(1, 2, 0)  # [H, W, 3]
