"""Forward passes as traced graphs (``vit_backbone.graphs``): the same numbers as the eager pass, no
Python per op, one graph per size and blocks, eager where a graph cannot serve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vit_backbone import graphs as graphs_module
from vit_backbone import load_backbone
from vit_backbone.backbone import Backbone
from vit_backbone.graphs import ForwardGraphs

FAMILIES = ("dinov2", "dinov2_registers", "dinov3", "vit", "clip", "siglip")


def pixels(batch: int, side: int = 28, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(seed))  # [B, 3, H, W]


def with_graphs(path: Path) -> Backbone:
    bb = load_backbone(path)
    bb.use_graphs()
    return bb


@pytest.mark.parametrize("family", FAMILIES)
def test_a_graph_gives_the_eager_features_of_every_family(
    family: str, tiny_checkpoints: dict[str, Path]
) -> None:
    eager = load_backbone(tiny_checkpoints[family])
    bb = with_graphs(tiny_checkpoints[family])
    graphs = bb.graphs
    assert graphs is not None
    x = pixels(4, side=2 * bb.patch_size[0])
    want = eager.features(x, layers=[0])
    for _ in range(graphs.trace_after):  # seen once: eager; the second time: traced
        bb.features(x, layers=[0])
    assert (len(graphs), graphs.traced, graphs.failed) == (1, 1, 0)
    for batch in (4, 1, 3):  # the batch size stays free: one graph
        got = bb.features(x[:batch], layers=[0])
        for name in ("cls", "patches", "pooler"):
            expected, actual = getattr(want, name), getattr(got, name)
            if expected is None:
                assert actual is None
                continue
            torch.testing.assert_close(actual, expected[:batch], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            got.layers[0].patches, want.layers[0].patches[:batch], atol=1e-5, rtol=1e-5
        )
    assert graphs.traced == 1


def test_a_graph_of_chosen_blocks_matches_the_early_exit(tiny_checkpoints: dict[str, Path]) -> None:
    eager = load_backbone(tiny_checkpoints["dinov2"])
    bb = with_graphs(tiny_checkpoints["dinov2"])
    x = pixels(2, seed=1)
    want = eager.layer_features(x, [0, 1])
    for _ in range(3):
        got = bb.layer_features(x, [1, 0])
    assert bb.graphs is not None and len(bb.graphs) == 1
    for block in (0, 1):
        torch.testing.assert_close(got[block].patches, want[block].patches, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[block].cls, want[block].cls, atol=1e-5, rtol=1e-5)


def test_a_graph_runs_no_python_of_the_model(tiny_checkpoints: dict[str, Path]) -> None:
    """What lets passes run side by side: once traced, a pass enters none of the model's Python modules
    (an eager pass enters every block), so it never needs the GIL between ops."""
    bb = with_graphs(tiny_checkpoints["dinov2"])
    x = pixels(2)
    for _ in range(2):
        bb.layer_features(x, [1])
    entered: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda m, args, name=name: entered.append(name))
        for name, module in bb.model.named_modules()
        if name
    ]
    try:
        bb.layer_features(x, [1])
        assert entered == [bb.spec.final_norm]  # the final norm runs eagerly, after the graph
        entered.clear()
        bb.use_graphs(False)
        bb.layer_features(x, [1])
        assert any("layer" in name for name in entered)  # eager: the blocks' Python runs
    finally:
        for handle in handles:
            handle.remove()


def test_letterboxed_batches_and_sizes_seen_once_stay_eager(tiny_checkpoints: dict[str, Path]) -> None:
    eager = load_backbone(tiny_checkpoints["dinov2"])
    bb = with_graphs(tiny_checkpoints["dinov2"])
    graphs = bb.graphs
    assert graphs is not None
    x = pixels(2)
    valid = torch.ones(2, 2, 2)
    valid[0, :, 1] = 0  # the first image is letterboxed: its right column is padding
    for _ in range(3):
        got = bb.layer_features(x, [1], valid=valid)[1]
    assert len(graphs) == 0
    torch.testing.assert_close(got.patches, eager.layer_features(x, [1], valid=valid)[1].patches)
    bb.layer_features(pixels(1, side=42), [1])  # a size seen once
    assert len(graphs) == 0


def test_graphs_are_kept_per_size_least_recently_used_first(tiny_checkpoints: dict[str, Path]) -> None:
    bb = with_graphs(tiny_checkpoints["dinov2"])
    bb.graphs = graphs = ForwardGraphs(slots=2, trace_after=1)
    for side in (14, 28, 42):
        bb.layer_features(pixels(1, side=side), [1])
    assert len(graphs) == 2 and graphs.traced == 3
    assert [key[1] for key in graphs._graphs] == [(2, 2), (3, 3)]
    bb.layer_features(pixels(1, side=14), [1])  # the dropped size is not traced again
    assert graphs.traced == 3 and graphs.failed == 1


def test_a_failed_trace_or_a_differing_graph_falls_back_to_eager_for_good(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    eager = load_backbone(tiny_checkpoints["dinov2"])
    want = eager.features(pixels(2)).cls
    bb = with_graphs(tiny_checkpoints["dinov2"])
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("the tracer cannot follow this")

    monkeypatch.setattr(torch.jit, "trace", broken)
    for _ in range(4):
        torch.testing.assert_close(bb.features(pixels(2)).cls, want)
    assert bb.graphs is not None and (len(bb.graphs), bb.graphs.failed, len(calls)) == (0, 1, 1)
    assert "not traced, running eagerly: the tracer cannot follow this" in caplog.text
    monkeypatch.undo()

    bb.use_graphs()
    monkeypatch.setattr(graphs_module, "_matches", lambda expected, got: False)
    for _ in range(3):
        torch.testing.assert_close(bb.features(pixels(2)).cls, want)
    assert bb.graphs is not None and (len(bb.graphs), bb.graphs.failed) == (0, 1)
    assert "differs from the eager pass" in caplog.text


def test_matches_holds_graphs_to_the_eager_pass() -> None:
    a = torch.ones(2, 3)
    assert graphs_module._matches((a,), (a + 5e-5,))
    assert not graphs_module._matches((a,), (a + 1e-3,))
    assert not graphs_module._matches((a,), (a.double(),))
    assert not graphs_module._matches((a,), (a, a))
    with pytest.raises(ValueError, match="at least 1"):
        ForwardGraphs(slots=0)
