"""A checkpoint whose config.json omits transformers' default values (as transformers 4.x writes it) is
served like the full one, and an unusable config stops `vitembed serve` with one line naming the file and
the field."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vitembed.cli.main import main
from vitembed.engine.engine import EmbedOptions, Engine, RequestTicket
from vitembed.metrics import Metrics
from vitembed.settings import ServiceSettings

from vit_backbone import load_backbone


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def clip_12_blocks(
    tmp_path_factory: pytest.TempPathFactory, minimal_copy: Callable[[Path, Path], Path]
) -> tuple[Path, Path]:
    """A full CLIP dual encoder with transformers' default depth (12 blocks, 32 wide): its minimal config's
    vision_config has no num_hidden_layers, the field that used to stop `vitembed serve` with a KeyError."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    vision = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 16}
    full = tmp_path_factory.mktemp("clip12") / "full"
    tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config={**vision, "image_size": 64})).save_pretrained(
        full
    )
    tf.CLIPImageProcessorPil(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
    ).save_pretrained(full)
    minimal = minimal_copy(full, full.parent / "minimal")
    written = json.loads((minimal / "config.json").read_text())["vision_config"]
    assert "num_hidden_layers" not in written and written["patch_size"] == 16
    return full, minimal


def test_engine_serves_a_minimal_config_clip_checkpoint(clip_12_blocks: tuple[Path, Path]) -> None:
    full, minimal = clip_12_blocks
    settings = ServiceSettings(models={"clip": str(minimal)}, precision="float32")
    engine = Engine(settings, Metrics())
    engine.start()
    try:
        images = [_jpeg(seed) for seed in range(3)]
        deadline = time.monotonic() + 30
        outcome = asyncio.run(
            engine.embed("clip", images, EmbedOptions(), ticket=RequestTicket(deadline), deadline=deadline)
        )
        assert engine.model_infos()["clip"]["depth"] == 12
    finally:
        engine.stop()
    expected = load_backbone(full).embed(images)  # the full config's model
    np.testing.assert_allclose(outcome.vectors, expected, atol=1e-5)


def test_serve_with_an_unusable_config_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], minimal_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(minimal_checkpoints["clip"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["hidden_size"] = "wide"
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["serve", "--model", f"broken={folder}"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (
        f"vitembed serve: error: model 'broken': {folder / 'config.json'}: "
        "field vision_config.hidden_size must be an integer, got 'wide'\n"
    )
