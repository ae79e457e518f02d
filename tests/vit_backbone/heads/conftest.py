"""Fixtures for the head tests: the tiny random-init DINOv2 and generated labelled / segmentation folders."""

from __future__ import annotations

from pathlib import Path

import pytest
from heads_synthetic import make_labelled_folder, make_segmentation_folder

from vit_backbone import Backbone, load_backbone


@pytest.fixture(scope="session")
def tiny(tiny_checkpoints: dict[str, Path]) -> Backbone:
    return load_backbone(tiny_checkpoints["dinov2"])


@pytest.fixture(scope="session")
def labelled_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 visibly different classes x 20 images (64 px PNGs)."""
    return make_labelled_folder(tmp_path_factory.mktemp("labelled"), per_class=20)


@pytest.fixture(scope="session")
def fresh_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other images of the same classes (another seed): never seen in training."""
    return make_labelled_folder(tmp_path_factory.mktemp("fresh"), per_class=8, seed=1)


@pytest.fixture(scope="session")
def seg_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_segmentation_folder(tmp_path_factory.mktemp("seg"), count=30)
