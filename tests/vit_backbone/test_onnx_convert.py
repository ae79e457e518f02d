"""The ONNX -> Dinov2 conversion's key naming and load check, on a tiny random Dinov2Model (no real weights).

The real graph is converted and compared with onnxruntime in test_embedded.py (slow tests).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vit_backbone import onnx_convert
from vit_backbone.errors import UnsupportedModelError


def _tiny_hub_checkpoint(folder: Path) -> tuple[object, dict[str, np.ndarray]]:
    """A random Dinov2Model written under the hub's names, the way the conversion writes its checkpoint."""
    import torch
    from safetensors.numpy import save_file
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    torch.manual_seed(0)
    state = Dinov2Model(config).state_dict()
    tensors = {onnx_convert.hub_key(k): v.detach().numpy().copy() for k, v in state.items()}
    folder.mkdir()
    config.save_pretrained(str(folder))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return config, tensors


def test_hub_key() -> None:
    assert onnx_convert.hub_key("encoder.layer.3.attention.q_proj.weight") == (
        "encoder.layer.3.attention.attention.query.weight"
    )
    assert onnx_convert.hub_key("encoder.layer.3.attention.k_proj.bias") == (
        "encoder.layer.3.attention.attention.key.bias"
    )
    assert onnx_convert.hub_key("encoder.layer.3.attention.v_proj.weight") == (
        "encoder.layer.3.attention.attention.value.weight"
    )
    assert onnx_convert.hub_key("encoder.layer.3.attention.o_proj.weight") == (
        "encoder.layer.3.attention.output.dense.weight"
    )
    for name in ("encoder.layer.0.attention.attention.query.weight", "embeddings.position_embeddings"):
        assert onnx_convert.hub_key(name) == name


def test_hub_names_load_in_the_installed_transformers(tmp_path: Path) -> None:
    """Hub names load with no missing/unexpected keys and the very same values (verify_loads passes)."""
    config, tensors = _tiny_hub_checkpoint(tmp_path / "ckpt")
    assert "encoder.layer.0.attention.attention.query.weight" in tensors
    assert onnx_convert._installed_names(tensors, config).keys() == tensors.keys()
    onnx_convert.verify_loads(tmp_path / "ckpt", tensors)


def test_verify_loads_catches_other_values(tmp_path: Path) -> None:
    _, tensors = _tiny_hub_checkpoint(tmp_path / "ckpt")
    tensors["encoder.layer.1.mlp.fc2.bias"] = tensors["encoder.layer.1.mlp.fc2.bias"] + 1
    with pytest.raises(UnsupportedModelError, match=r"different values.*mlp\.fc2\.bias"):
        onnx_convert.verify_loads(tmp_path / "ckpt", tensors)


def test_state_dict_must_cover_dinov2_exactly(tmp_path: Path) -> None:
    config, tensors = _tiny_hub_checkpoint(tmp_path / "ckpt")
    missing = {k: v for k, v in tensors.items() if k != "embeddings.cls_token"}
    with pytest.raises(UnsupportedModelError, match=r"missing \['embeddings\.cls_token'\]"):
        onnx_convert._installed_names(missing, config)
    extra = {**tensors, "decoder.conv.weight": np.zeros(3, dtype=np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"unexpected \['decoder\.conv\.weight'\]"):
        onnx_convert._installed_names(extra, config)
    wrong = {**tensors, "embeddings.cls_token": np.zeros((1, 1, 8), dtype=np.float32)}
    with pytest.raises(UnsupportedModelError, match=r"wrong shapes \['embeddings\.cls_token'\]"):
        onnx_convert._installed_names(wrong, config)


def test_configs() -> None:
    config = onnx_convert.dinov2_config()
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (384, 12, 6)
    assert (config.patch_size, config.image_size, config.layer_norm_eps) == (14, 518, 1e-6)
    assert config.architectures == ["Dinov2Model"]
    processor = onnx_convert.preprocessor_config()
    assert processor["size"] == {"shortest_edge": 256}
    assert processor["crop_size"] == {"height": 224, "width": 224}
    processor["size"]["shortest_edge"] = 1  # a fresh copy each time
    assert onnx_convert.preprocessor_config()["size"] == {"shortest_edge": 256}
