"""Saving and loading heads: weights in safetensors, the card as JSON beside them.

``save_head(head, "cats.safetensors")`` writes ``cats.safetensors`` and ``cats.json``; any other path is
a folder holding ``head.safetensors`` and ``head.json``. The card is also stored in the safetensors
metadata (key ``vitembed_head``), so the weights file alone is self-describing; on loading, a JSON card
beside it must say the same. No pickle anywhere: a head file cannot run code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import InvalidOptionError, ModelNotFoundError
from .base import Head
from .card import HeadCard
from .compat import check_compatible
from .knn import KnnHead
from .linear import LinearHead
from .patch import PatchHead

if TYPE_CHECKING:
    from ..backbone import Backbone

METADATA_KEY = "vitembed_head"
FOLDER_WEIGHTS = "head.safetensors"
_KINDS: dict[str, type[LinearHead] | type[KnnHead] | type[PatchHead]] = {
    "linear": LinearHead,
    "knn": KnnHead,
    "patch": PatchHead,
}


def head_files(path: str | Path) -> tuple[Path, Path]:
    """(weights, card) for a ``.safetensors``/``.json`` path or a folder."""
    path = Path(path).expanduser()
    if path.suffix in (".safetensors", ".json"):
        return path.with_suffix(".safetensors"), path.with_suffix(".json")
    return path / FOLDER_WEIGHTS, path / "head.json"


def save_head(head: Head, path: str | Path) -> tuple[Path, Path]:
    weights, card_file = head_files(path)
    weights.parent.mkdir(parents=True, exist_ok=True)
    card_json = head.card.to_json()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in head.tensors().items()}
    save_file(tensors, str(weights), metadata={METADATA_KEY: card_json})
    card_file.write_text(card_json + "\n")
    # safetensors creates its file private (0600); the weights are as shareable as the card beside them
    weights.chmod(card_file.stat().st_mode & 0o777)
    return weights, card_file


def read_card(path: str | Path) -> HeadCard:
    """The card alone (no tensors loaded): the JSON beside the weights, else the weights' metadata."""
    weights, card_file = head_files(path)
    if card_file.is_file():
        return HeadCard.from_json(card_file.read_text())
    return HeadCard.from_json(_metadata_card(weights))


def _metadata_card(weights: Path) -> str:
    if not weights.is_file():
        raise ModelNotFoundError(f"no head at {weights} (expected HEAD.safetensors + HEAD.json, or a folder)")
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as handle:
            text = (handle.metadata() or {}).get(METADATA_KEY)
    except (SafetensorError, OSError) as exc:
        raise InvalidOptionError(f"{weights} is not a readable safetensors file: {exc}") from exc
    if text is None:
        raise InvalidOptionError(f"{weights} holds no head card (metadata key {METADATA_KEY!r})")
    return text


def load_head(path: str | Path, backbone: Backbone | None = None) -> Head:
    """Load a head; with ``backbone``, refuse it (``HeadMismatchError``) unless the card's revision,
    preprocessing hash, blocks and width match that backbone."""
    weights, card_file = head_files(path)
    stored = HeadCard.from_json(_metadata_card(weights))
    card = stored
    if card_file.is_file():
        card = HeadCard.from_json(card_file.read_text())
        if card != stored:
            raise InvalidOptionError(
                f"{card_file} does not describe {weights} (the card in the weights' metadata differs); "
                "keep the pair written together"
            )
    if backbone is not None:
        check_compatible(card, backbone, what=f"head {str(path)!r}")
    try:
        tensors: dict[str, torch.Tensor] = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise InvalidOptionError(f"{weights} is not a readable safetensors file: {exc}") from exc
    return _KINDS[card.kind].from_tensors(card, tensors)


def card_summary(card: HeadCard) -> str:
    """Human-readable lines for ``vitembed heads show``."""
    facts = card.to_dict()
    facts["hyperparameters"] = json.dumps(card.hyperparameters, sort_keys=True)
    facts["classes"] = ", ".join(card.classes)
    width = max(len(key) for key in facts)
    return "\n".join(f"{key.ljust(width)}  {value}" for key, value in sorted(facts.items()))
