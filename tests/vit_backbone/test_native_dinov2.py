"""The native DINOv2 forward pass equals transformers' (``Dinov2Model``, ``Dinov2WithRegistersModel``), loads
checkpoints saved under either naming, falls back to transformers for anything else, and spares the serve
path transformers' model code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from vit_backbone import load_backbone
from vit_backbone.checkpoint import load_config
from vit_backbone.native_dinov2 import NativeDinov2, load_native

TINY: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "patch_size": 14,
    "image_size": 56,
}
VARIANTS = {
    "plain": lambda: tf.Dinov2Model(tf.Dinov2Config(**TINY)),
    "swiglu": lambda: tf.Dinov2Model(tf.Dinov2Config(**TINY, use_swiglu_ffn=True, layerscale_value=0.1)),
    "gelu_new": lambda: tf.Dinov2Model(tf.Dinov2Config(**TINY, hidden_act="gelu_new", qkv_bias=False)),
    "registers": lambda: tf.Dinov2WithRegistersModel(
        tf.Dinov2WithRegistersConfig(**TINY, num_register_tokens=4)
    ),
}


def _save(variant: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = VARIANTS[variant]().eval()
    with torch.no_grad():  # layer scale and biases start at constants: randomise them so they are tested
        for name, param in model.named_parameters():
            if "lambda1" in name or name.endswith(".bias") or "token" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _legacy_names(folder: Path) -> None:
    """Rewrite the weights under transformers 4.x names (what the embedded conversion and most hub
    checkpoints hold): ``attention.attention.query``, ``attention.output.dense``, SwiGLU ``weights_in``."""
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        key = key.replace(".attention.q_proj.", ".attention.attention.query.")
        key = key.replace(".attention.k_proj.", ".attention.attention.key.")
        key = key.replace(".attention.v_proj.", ".attention.attention.value.")
        key = key.replace(".attention.o_proj.", ".attention.output.dense.")
        key = key.replace(".mlp.down_proj.", ".mlp.weights_out.")
        if ".mlp.gate_proj." in key:
            up = tensors[key.replace(".gate_proj.", ".up_proj.")]
            out[key.replace(".gate_proj.", ".weights_in.")] = torch.cat([tensor, up]).contiguous()
            continue
        if ".mlp.up_proj." in key:
            continue
        out[key] = tensor.contiguous()
    save_file(out, str(weights), metadata={"format": "pt"})


@pytest.mark.parametrize("legacy", [False, True], ids=["v5-names", "v4-names"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_equals_transformers(tmp_path: Path, variant: str, legacy: bool) -> None:
    reference = _save(variant, tmp_path)
    if legacy:
        _legacy_names(tmp_path)
    native = load_native(tmp_path, load_config(tmp_path), torch.float32)
    assert isinstance(native, NativeDinov2)
    pixels = torch.randn(3, 3, 56, 56)  # [B, 3, H, W]
    tokens = (56 // 14) ** 2 + 1 + (4 if variant == "registers" else 0)
    mask = torch.ones(3, tokens, dtype=torch.long)  # [B, T]
    mask[1, tokens // 2 :] = 0  # one image's second half left out of attention, as a letterbox is
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            want = reference(pixels, output_hidden_states=True, **kwargs)
            got = native(pixels, output_hidden_states=True, **kwargs)
            assert got.hidden_states is not None and len(got.hidden_states) == len(want.hidden_states) == 4
            for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-5, rtol=1e-5)
    masked = native(pixels, attention_mask=mask).last_hidden_state
    assert (masked[1] - native(pixels).last_hidden_state[1]).abs().max() > 1e-3  # the mask did something


@pytest.mark.parametrize("variant", ["plain", "registers"])
def test_backbone_features_equal_the_transformers_path(
    tmp_path: Path, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``load_backbone``: the position rule at a non-native, non-square size, early exit at a block,
    letterbox masks: the native network gives what transformers' gives."""
    _save(variant, tmp_path, seed=3)
    native = load_backbone(tmp_path)
    assert isinstance(native.model, NativeDinov2)
    monkeypatch.setattr("vit_backbone.loading.load_native", lambda *a, **k: None)
    reference = load_backbone(tmp_path)
    assert type(reference.model).__name__.startswith("Dinov2")
    pixels = torch.randn(2, 3, 70, 98)  # [B, 3, H, W]: a 5x7 grid against the 4x4 table
    valid = torch.ones(2, 5, 7)  # [B, h, w]
    valid[0, :, 5:] = 0  # a letterboxed image
    for kwargs in ({}, {"valid": valid}):
        got = native.features(pixels, layers=[0, 1], **kwargs)
        want = reference.features(pixels, layers=[0, 1], **kwargs)
        torch.testing.assert_close(got.cls, want.cls, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.patches, want.patches, atol=1e-5, rtol=1e-5)
        for block in (0, 1):
            torch.testing.assert_close(
                got.layers[block].patches, want.layers[block].patches, atol=1e-5, rtol=1e-5
            )
        early = native.layer_features(pixels, [1], **kwargs)[1]
        torch.testing.assert_close(early.patches, want.layers[1].patches, atol=1e-5, rtol=1e-5)


def test_checkpoint_with_a_head_falls_back_to_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = tf.Dinov2Config(**TINY)
    config.num_labels = 3
    model = tf.Dinov2ForImageClassification(config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert load_native(tmp_path, load_config(tmp_path), torch.float32) is None  # classifier.* is not ours
    backbone = load_backbone(tmp_path)
    assert not isinstance(backbone.model, NativeDinov2)
    pixels = torch.randn(1, 3, 56, 56)  # [B, 3, H, W]
    with torch.no_grad():
        want = model.dinov2(pixels).last_hidden_state[:, 0]  # [B, D]
    torch.testing.assert_close(backbone.features(pixels).cls, want, atol=1e-5, rtol=1e-5)


def test_loading_dinov2_imports_no_transformers_model_code(tmp_path: Path) -> None:
    _save("plain", tmp_path)
    code = (
        "import sys\n"
        "from vit_backbone import load_backbone\n"
        f"backbone = load_backbone({str(tmp_path)!r})\n"
        "import torch\n"
        "backbone.features(torch.randn(1, 3, 56, 56))\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
