"""Fixtures for the client tests: real ``vitembed serve`` processes on 127.0.0.1 serving the tiny random-init
DINOv2 (float32, so the client's numbers equal the library's to 1e-5), the library on the same checkpoint,
and small JPEG photographs."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from clientserver import API_KEY, FLOOD_FLAGS, ServerProcess, start_server

from vit_backbone import Backbone, load_backbone


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoints: dict[str, Path]) -> Path:
    return tiny_checkpoints["dinov2"]


@pytest.fixture(scope="session")
def reference(tiny_path: Path) -> Backbone:
    return load_backbone(tiny_path)


@pytest.fixture(scope="session")
def server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Default limits; a batch waits up to 20 ms to fill."""
    started = start_server(tiny_path, tmp_path_factory.mktemp("client-serve"), "--max-wait-ms", "20")
    yield started
    started.stop()


@pytest.fixture(scope="session")
def flood_server(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = start_server(tiny_path, tmp_path_factory.mktemp("client-flood"), *FLOOD_FLAGS, api_key=API_KEY)
    yield started
    started.stop()


@pytest.fixture(scope="session")
def photos(sample_images: list[Any]) -> list[bytes]:
    """24 distinct small JPEGs: the four bundled photographs at six sizes."""
    out = []
    for width, height in ((64, 48), (80, 96), (120, 72), (57, 101), (96, 96), (140, 60)):
        for image in sample_images:
            buffer = io.BytesIO()
            image.resize((width, height)).save(buffer, format="JPEG", quality=90)
            out.append(buffer.getvalue())
    return out


@pytest.fixture(scope="session")
def write_files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[bytes]], list[Path]]:
    folder = tmp_path_factory.mktemp("photos")

    def write(images: list[bytes]) -> list[Path]:
        paths = [folder / f"{i}.jpg" for i in range(len(images))]
        for path, data in zip(paths, images, strict=True):
            path.write_bytes(data)
        return paths

    return write
