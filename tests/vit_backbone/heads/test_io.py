"""Saving and loading heads, the card's JSON round trip, and refusals of mismatched backbones/features."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vit_backbone import Backbone, load_backbone
from vit_backbone.errors import InvalidOptionError, ModelNotFoundError
from vit_backbone.heads import (
    HeadCard,
    HeadMismatchError,
    TrainOptions,
    check_compatible,
    load_head,
    read_card,
    save_head,
    train_head,
)
from vit_backbone.heads.io import head_files


@pytest.fixture(scope="module")
def trained(tiny: Backbone, labelled_folder: Path) -> dict[str, object]:
    return {
        kind: train_head(tiny, labelled_folder, TrainOptions(kind=kind, pooling="mean", layers=(0,))).head
        for kind in ("linear", "knn")
    }


@pytest.mark.parametrize("kind", ["linear", "knn"])
@pytest.mark.parametrize("form", ["file", "folder"])
def test_round_trip(kind: str, form: str, trained: dict[str, object], tiny: Backbone, tmp_path: Path) -> None:
    head = trained[kind]
    target = tmp_path / ("cats.safetensors" if form == "file" else "cats")
    weights, card_file = save_head(head, target)  # type: ignore[arg-type]
    assert (weights.name, card_file.name) == (
        ("cats.safetensors", "cats.json") if form == "file" else ("head.safetensors", "head.json")
    )
    loaded = load_head(target, tiny)
    assert loaded.card == head.card  # type: ignore[attr-defined]
    features = torch.randn(5, 32)
    torch.testing.assert_close(loaded.predict_proba(features), head.predict_proba(features), atol=0, rtol=0)  # type: ignore[attr-defined]
    assert json.loads(card_file.read_text()) == head.card.to_dict()  # type: ignore[attr-defined]
    assert read_card(card_file) == head.card  # type: ignore[attr-defined]
    card_file.unlink()  # the weights alone are self-describing
    assert load_head(weights).card == head.card  # type: ignore[attr-defined]


def test_card_json_round_trip(trained: dict[str, object]) -> None:
    card: HeadCard = trained["linear"].card  # type: ignore[attr-defined]
    assert HeadCard.from_json(card.to_json()) == card
    raw = card.to_dict()
    with pytest.raises(InvalidOptionError, match=r"unknown head card field\(s\) \['colour'\]"):
        HeadCard.from_dict({**raw, "colour": "red"})
    with pytest.raises(InvalidOptionError, match=r"at least 2 classes"):
        HeadCard.from_dict({**raw, "classes": ["one"]})
    with pytest.raises(InvalidOptionError, match=r"unknown head kind 'mlp'"):
        HeadCard.from_dict({**raw, "kind": "mlp"})


def test_other_revision_is_refused_with_the_differences(
    trained: dict[str, object], make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    head = trained["linear"]
    path = tmp_path / "h.safetensors"
    save_head(head, path)  # type: ignore[arg-type]
    other = load_backbone(make_checkpoint("dinov2", seed=1))
    card = head.card  # type: ignore[attr-defined]
    assert other.checkpoint.revision != card.revision
    with pytest.raises(HeadMismatchError) as caught:
        load_head(path, other)
    assert str(caught.value) == (
        f"head {str(path)!r} does not match backbone 'dinov2': "
        f"revision {card.revision} != {other.checkpoint.revision}"
    )
    assert caught.value.code == "head_mismatch"


def test_other_pooling_layers_or_width_are_refused(
    trained: dict[str, object], tiny: Backbone, make_checkpoint: Callable[..., Path]
) -> None:
    card = trained["linear"].card  # type: ignore[attr-defined]
    check_compatible(card, tiny, pooling="mean", layers=[0])  # the features it was trained on: fine
    with pytest.raises(HeadMismatchError) as caught:
        check_compatible(card, tiny, pooling="cls", layers=[-1])
    assert (
        str(caught.value) == "the head does not match backbone 'dinov2': pooling mean != cls; layers 0 != 1"
    )
    with pytest.raises(HeadMismatchError) as caught:
        check_compatible(card, pooling="mean", layers=[0], normalized=True)
    assert str(caught.value) == "the head does not match these features: normalized False != True"
    wider = HeadCard.from_dict({**card.to_dict(), "feature_dim": 64})
    with pytest.raises(HeadMismatchError, match=r"dim 64 != 32$"):
        check_compatible(wider, tiny)
    deeper = HeadCard.from_dict({**card.to_dict(), "layers": [7]})
    with pytest.raises(HeadMismatchError, match=r"layers 7 do not exist in a 2-block model$"):
        check_compatible(deeper, tiny)


def test_broken_head_files_are_refused(trained: dict[str, object], tmp_path: Path) -> None:
    head = trained["knn"]
    weights, card_file = save_head(head, tmp_path / "k.safetensors")  # type: ignore[arg-type]
    card_file.write_text(card_file.read_text().replace('"knn"', '"linear"'))
    with pytest.raises(InvalidOptionError, match=r"does not describe .*k.safetensors"):
        load_head(weights)
    with pytest.raises(ModelNotFoundError, match=r"no head at"):
        load_head(tmp_path / "missing")
    weights.write_bytes(b"not a safetensors file")
    card_file.unlink()
    with pytest.raises(InvalidOptionError, match=r"not a readable safetensors file"):
        load_head(weights)
    assert head_files(tmp_path / "x.json") == (tmp_path / "x.safetensors", tmp_path / "x.json")
