"""The PCA map and patch-to-patch cosines equal a plain numpy computation on the library's own patch tokens
(``Backbone.embed(pooling="patch")``) for the same image and options; the sign convention holds; the model
view undoes the processor's normalisation exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vit_backbone import load_backbone
from vit_backbone.errors import InvalidOptionError
from vit_backbone.patch_maps import model_view, patch_pca, patch_similarity

TOL = 1e-5


def numpy_pca_rgb(tokens: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """The textbook recipe, written out: centre, SVD, orient by the largest loading, project, min-max."""
    h, w, d = tokens.shape
    x = tokens.reshape(-1, d).astype(np.float64)
    rows = np.ones(h * w, bool) if keep is None else keep.reshape(-1)
    used = x[rows]
    mean = used.mean(0)
    _, _, vt = np.linalg.svd(used - mean, full_matrices=False)
    out = np.zeros((h * w, 3))
    for i in range(3):
        v = vt[i] * np.sign(vt[i][np.argmax(np.abs(vt[i]))])
        p = (used - mean) @ v
        out[rows, i] = (p - p.min()) / (p.max() - p.min())
    return out.reshape(h, w, 3)


@pytest.fixture(scope="module")
def tokens(tiny_checkpoints: dict[str, Path], sample_images: list[Any]) -> dict[str, np.ndarray]:
    backbone = load_backbone(tiny_checkpoints["dinov2"])
    grids = backbone.embed(sample_images[:2], pooling="patch", layers=[0], policy="pad", size=(112, 112))
    return {"astronaut": grids[0], "coffee": grids[1]}  # [8, 8, 32] each


def test_pca_equals_numpy_on_the_library_tokens(tokens: dict[str, np.ndarray]) -> None:
    for grid in tokens.values():
        result = patch_pca(grid)
        np.testing.assert_allclose(result.rgb, numpy_pca_rgb(grid), atol=TOL)
        assert result.foreground.all() and result.threshold is None
        assert sum(result.explained) < 1 and result.explained[0] >= result.explained[1] >= result.explained[2]
        assert result.rgb.min() == 0 and result.rgb.max() == 1


def test_sign_convention_survives_a_flipped_input_direction(tokens: dict[str, np.ndarray]) -> None:
    """Negating every token flips every principal direction; the rule flips them back, so the colours of
    a direction depend on the direction, not on the SVD's arbitrary sign."""
    grid = tokens["astronaut"]
    shifted = grid + 3.0  # the same centred data: the same map
    np.testing.assert_allclose(patch_pca(shifted).rgb, patch_pca(grid).rgb, atol=TOL)
    loadings = np.linalg.svd(grid.reshape(-1, grid.shape[-1]) - grid.reshape(-1, grid.shape[-1]).mean(0))[2]
    top = loadings[0][np.argmax(np.abs(loadings[0]))]
    flipped = patch_pca(-grid).rgb[..., 0]  # components of -x are those of x, re-oriented by the rule
    expected = patch_pca(grid).rgb[..., 0]
    np.testing.assert_allclose(flipped, 1 - expected, atol=TOL)  # projections negate: min-max mirrors
    assert top != 0


def test_background_removal_thresholds_the_first_component(tokens: dict[str, np.ndarray]) -> None:
    grid = tokens["coffee"]
    result = patch_pca(grid, background_threshold=0.4)
    d = grid.shape[-1]
    x = grid.reshape(-1, d).astype(np.float64)
    centred = x - x.mean(0)
    v = np.linalg.svd(centred, full_matrices=False)[2][0]
    first = (centred @ v).reshape(grid.shape[:2])
    border = np.ones(grid.shape[:2], bool)
    border[1:-1, 1:-1] = False
    if first[border].mean() > first.mean():
        first = -first
    scaled = (first - first.min()) / (first.max() - first.min())
    np.testing.assert_allclose(result.first, scaled, atol=TOL)
    keep = scaled > 0.4
    assert (result.foreground == keep).all() and 2 <= keep.sum() < keep.size
    np.testing.assert_allclose(result.rgb, numpy_pca_rgb(grid, keep), atol=TOL)
    assert (result.rgb[~keep] == 0).all()


def test_the_letterbox_is_left_out_of_the_components(
    tiny_checkpoints: dict[str, Path], sample_images: list[Any]
) -> None:
    """pad's letterbox patches (``Prepared.valid`` 0) take no part: the map equals numpy on the patches that
    hold image, the letterbox is black and outside the foreground, and an all-ones ``valid`` changes
    nothing."""
    backbone = load_backbone(tiny_checkpoints["dinov2"])
    coffee = sample_images[1]  # 600 x 400: a square box letterboxes it above and below
    grid = backbone.embed(coffee, pooling="patch", layers=[0], policy="pad", size=(112, 112))[0]  # [8, 8, 32]
    valid = backbone.prepare(coffee, policy="pad", size=(112, 112))[0].valid
    assert valid is not None
    holds = valid > 0
    assert 0 < holds.sum() < holds.size
    result = patch_pca(grid, valid=valid)
    np.testing.assert_allclose(result.rgb, numpy_pca_rgb(grid, holds), atol=TOL)
    assert (result.rgb[~holds] == 0).all() and (result.foreground == holds).all()
    assert (result.first[~holds] == 0).all() and result.first[holds].max() == 1
    thresholded = patch_pca(grid, valid=valid, background_threshold=0.3)
    assert not thresholded.foreground[~holds].any() and thresholded.foreground.sum() < holds.sum()
    np.testing.assert_allclose(patch_pca(grid, valid=np.ones(grid.shape[:2])).rgb, patch_pca(grid).rgb)
    with pytest.raises(InvalidOptionError, match="shape"):
        patch_pca(grid, valid=valid[:-1])
    with pytest.raises(InvalidOptionError, match="no patch holds image"):
        patch_pca(grid, valid=np.zeros(grid.shape[:2]))


def test_patch_similarity_equals_numpy_cosines(tokens: dict[str, np.ndarray]) -> None:
    query, target = tokens["astronaut"], tokens["coffee"]
    got = patch_similarity(query, 3, 5, target)
    q = query[3, 5].astype(np.float64)
    expected = (target @ q) / (np.linalg.norm(target, axis=-1) * np.linalg.norm(q))
    np.testing.assert_allclose(got, expected, atol=TOL)
    itself = patch_similarity(query, 3, 5, query)
    assert np.unravel_index(np.argmax(itself), itself.shape) == (3, 5)
    assert itself[3, 5] == pytest.approx(1.0, abs=TOL)
    with pytest.raises(InvalidOptionError, match=r"row must be in 0\.\.7"):
        patch_similarity(query, 8, 0, target)
    with pytest.raises(InvalidOptionError, match="wide"):
        patch_similarity(query, 0, 0, target[..., :5])


def test_model_view_undoes_the_normalisation(
    tiny_checkpoints: dict[str, Path], sample_images: list[Any]
) -> None:
    backbone = load_backbone(tiny_checkpoints["dinov2"])
    image = sample_images[1].resize((100, 50))
    squashed = backbone.prepare(image, policy="squash", size=(56, 112))[0]
    view = model_view(squashed.pixel_values.numpy(), backbone.preprocess_config)
    expected = np.asarray(image.resize((112, 56), resample=3))  # the processor's own bicubic resize
    assert view.shape == (56, 112, 3)
    assert np.abs(view.astype(int) - expected.astype(int)).max() <= 1  # float32 round trip
    padded = backbone.prepare(image, policy="pad", size=(112, 112))[0]
    letterbox = model_view(padded.pixel_values.numpy(), backbone.preprocess_config)[0, 0]
    mean = np.rint(np.asarray(backbone.preprocess_config.image_mean) * 255)
    assert np.abs(letterbox.astype(int) - mean).max() <= 1  # the letterbox is the mean colour
