"""Frozen heads in the server: binding each head to the served model it was trained on, checking what a
request asks of it, and computing its outputs from the batch's single forward pass.

A head binds to the served model whose checkpoint revision and preprocessing hash equal its card's (the
name may differ: ``embedded`` here, a folder name where it was trained). No match stops start-up with a
message that names both sides: a server must never answer with a head on the wrong features.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vit_backbone.checkpoint import CheckpointFacts, checkpoint_facts, models_matching
from vit_backbone.errors import InvalidOptionError, ModelNotFoundError, VitEmbedError
from vit_backbone.heads import Head, HeadCard, PatchHead, load_head, read_card
from vit_backbone.heads.card import precision_label
from vit_backbone.heads.patch import IGNORE
from vit_backbone.heads.predict import HeadInputs, head_inputs

if TYPE_CHECKING:
    from vit_backbone.backbone import Backbone
    from vit_backbone.pooling import Pooling
    from vit_backbone.preprocess import Preprocessor
    from vitembed.settings import ServiceSettings


log = logging.getLogger(__name__)


class HeadStartupError(ValueError):
    """A configured head that no served model can run."""


@dataclass(frozen=True)
class BoundHead:
    name: str
    path: str
    model: str  # the served model it runs on
    head: Head
    inputs: HeadInputs  # its features, resolved on that model

    @property
    def card(self) -> HeadCard:
        return self.head.card


def _no_match(
    name: str, path: str, card: HeadCard, served: Mapping[str, CheckpointFacts]
) -> HeadStartupError:
    listed = "; ".join(f"{m}: revision {r}, preprocess_hash {h}" for m, (r, h) in served.items())
    return HeadStartupError(
        f"head {name!r} ({path}) fits no served model: it was trained on {card.backbone!r} revision "
        f"{card.revision}, preprocess_hash {card.preprocess_hash}; served: {listed}"
    )


def _match(name: str, path: str, card: HeadCard, served: Mapping[str, CheckpointFacts]) -> str:
    fits = models_matching(served, card.revision, card.preprocess_hash)
    if not fits:
        raise _no_match(name, path, card, served)
    return fits[0]


def preflight_heads(settings: ServiceSettings) -> None:
    """Before any weights load: every head's card is readable and fits a served model."""
    served = {name: checkpoint_facts(target, settings.cache_dir) for name, target in settings.models.items()}
    for name, path in settings.heads.items():
        _match(name, path, read_card(path), served)


def bind_heads(heads: Mapping[str, str], backbones: Mapping[str, Backbone]) -> dict[str, BoundHead]:
    """Load each head, check it against its served model, and move its tensors to that model's device
    (heads are tiny: moving them once beats moving every batch's features to the CPU)."""
    served = {m: bb.facts for m, bb in backbones.items()}
    bound: dict[str, BoundHead] = {}
    for name, path in heads.items():
        try:
            model = _match(name, path, read_card(path), served)
            head = load_head(path, backbones[model])  # checks blocks, width and position rule too
        except VitEmbedError as exc:
            raise HeadStartupError(f"head {name!r} ({path}): {exc}") from exc
        backbone = backbones[model]
        _warn_precision(name, model, head.card, backbone)
        bound[name] = BoundHead(name, path, model, head.to(backbone.device), head_inputs(head.card, backbone))
    return bound


def _warn_precision(name: str, model: str, card: HeadCard, backbone: Backbone) -> None:
    served = precision_label(backbone.autocast)
    if card.precision is not None and card.precision != served:
        log.warning(
            "head %s was trained on %s features; model %s serves them in %s, so its probabilities differ "
            "slightly from the training-time ones (start with --precision %s for exact parity)",
            name,
            card.precision,
            model,
            served,
            card.precision,
        )


def get_head(bound: Mapping[str, BoundHead], name: str) -> BoundHead:
    head = bound.get(name)
    if head is None:
        served = ", ".join(bound) or "none"
        raise ModelNotFoundError(
            f"head {name!r} is not served; served heads: {served}", code="head_not_found"
        )
    return head


_PROBE_SOURCES = ((224, 224), (300, 500), (500, 300), (97, 1003))  # (H, W): square, wide, tall, odd


def pixel_plan(
    preprocessor: Preprocessor, policy: str, size: tuple[int, int] | None
) -> tuple[str, tuple[tuple[tuple[int, int], tuple[int, int] | None], ...]] | None:
    """What (policy, size) does to images, resolved: per probe source the output size and the resize.
    Two options with equal plans make the same pixels (``size`` omitted vs. the default size given)."""
    try:
        return policy, tuple(
            (
                preprocessor.target_size(policy, size, source),  # type: ignore[arg-type]
                preprocessor.min_decode_size(policy, size, source),  # type: ignore[arg-type]
            )
            for source in _PROBE_SOURCES
        )
    except VitEmbedError:
        return None  # not resolvable: compare the options as given


def same_pixels(
    preprocessor: Preprocessor,
    theirs: tuple[str, tuple[int, int] | None],
    ours: tuple[str, tuple[int, int] | None],
) -> bool:
    if theirs == ours:
        return True
    plans = pixel_plan(preprocessor, *theirs), pixel_plan(preprocessor, *ours)
    return plans[0] is not None and plans[0] == plans[1]


def select_heads(
    bound: Mapping[str, BoundHead],
    names: Sequence[str],
    model: str,
    policy: str,
    size: tuple[int, int] | None,
    preprocessor: Preprocessor,
) -> tuple[BoundHead, ...]:
    """The requested heads, in order, each checked against the request: it exists, runs on this model, and
    reads the pixels this request makes (same resolved policy and size), so that one forward pass serves
    all."""
    chosen: list[BoundHead] = []
    for name in dict.fromkeys(names):
        head = get_head(bound, name)
        if head.model != model:
            raise InvalidOptionError(
                f"head {name!r} runs on model {head.model!r}, not {model!r}; ask for model={head.model}",
                code="head_model_mismatch",
            )
        if not same_pixels(preprocessor, (head.inputs.policy, head.inputs.size), (policy, size)):
            theirs = f"policy={head.inputs.policy} size={_size(head.inputs.size)}"
            raise InvalidOptionError(
                f"head {name!r} reads images prepared with {theirs}; this request uses policy={policy} "
                f"size={_size(size)}: send the head's policy and size with this request",
                code="head_options_mismatch",
            )
        chosen.append(head)
    return tuple(chosen)


def _size(size: tuple[int, int] | None) -> str:
    return "native" if size is None else f"{size[0]},{size[1]}"


def pool_requests(
    pooling: Pooling, layers: list[int] | None, heads: Sequence[BoundHead]
) -> tuple[list[tuple[Pooling, list[int] | None]], list[int]]:
    """The distinct (pooling, layers) a batch needs — the embedding's first — and each head's position."""
    requests: list[tuple[Pooling, list[int] | None]] = [(pooling, layers)]
    where: list[int] = []
    for head in heads:
        wanted = (head.inputs.pooling, head.inputs.layers)
        if wanted not in requests:
            requests.append(wanted)
        where.append(requests.index(wanted))
    return requests, where


def head_outputs(
    heads: Sequence[BoundHead], pooled: Sequence[torch.Tensor], where: Sequence[int]
) -> list[dict[str, np.ndarray]]:
    """Per item, per head: class probabilities [C] (classifiers) or logits [h, w, C] (patch heads)."""
    per_head: dict[str, np.ndarray] = {}
    for head, position in zip(heads, where, strict=True):
        features = pooled[position].float()  # [b, F] or [b, h, w, F]
        if isinstance(head.head, PatchHead):
            per_head[head.name] = head.head.logits(features).cpu().numpy()  # [b, h, w, C]
        else:
            per_head[head.name] = head.head.predict_proba(features).cpu().numpy()  # [b, C]
    batch = len(pooled[0])
    return [{name: values[row] for name, values in per_head.items()} for row in range(batch)]


def labels_json(
    classes: Sequence[str], probabilities: np.ndarray, top_k: int | None = None
) -> list[dict[str, Any]]:
    """``[{"label", "probability"}]``, most probable first (ties: class order)."""
    order = np.argsort(-probabilities, kind="stable")[: top_k or len(classes)]
    return [{"label": classes[i], "probability": float(probabilities[i])} for i in order]


def non_finite_head(heads: Sequence[BoundHead], outputs: Mapping[str, np.ndarray]) -> str | None:
    """The first head whose outputs for this image hold NaN or infinity (the caller turns it into a 500)."""
    return next((h.name for h in heads if not np.isfinite(outputs[h.name]).all()), None)


def heads_provenance(heads: Sequence[BoundHead], served_precision: str) -> dict[str, Any]:
    """Per head: its kind, the precision its inputs were computed in here and the one it was trained on."""
    return {
        head.name: {
            "kind": head.card.kind,
            "precision": precision_label(served_precision),
            "head_precision": head.card.precision,
        }
        for head in heads
    }


def card_json(card: HeadCard) -> dict[str, Any]:
    """The card as ``/v1/models`` shows it: without ``data`` (a path on the server's filesystem)."""
    out = card.to_dict()
    out.pop("data", None)
    return out


def heads_json(
    heads: Sequence[BoundHead], outputs: Mapping[str, np.ndarray], valid: np.ndarray | None = None
) -> dict[str, Any]:
    """One image's head outputs for ``/v1/embed?heads=``: every class with its probability (classifiers),
    or the class-id grid [h][w] (patch heads; 255 where ``valid``, the image's share of each patch, is
    under half: pad's letterbox). Outputs are finite (checked with ``non_finite_head``)."""
    out: dict[str, Any] = {}
    for head in heads:
        values = outputs[head.name]
        if head.card.kind == "patch":
            grid = values.argmax(axis=-1)  # [h, w]
            if valid is not None:
                grid[valid < 0.5] = IGNORE
            out[head.name] = {"grid": grid.tolist()}
        else:
            out[head.name] = {"labels": labels_json(head.card.classes, values)}
    return out
