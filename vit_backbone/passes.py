"""The eager forward passes a ``Backbone`` runs, and traces into graphs (``vit_backbone.graphs``): the whole
network with the hidden states asked for, or the network up to the deepest requested block. Each is a
function of the pixels alone (the keyword arguments are read when it runs, so a letterbox's attention mask
set just before is seen), returning a tuple of tensors, which is what the tracer takes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

Pass = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


class StopForward(Exception):
    """Raised by a block hook to end a forward pass early; never leaves ``up_to_blocks``' pass."""


def whole_network(model: torch.nn.Module, kwargs: dict[str, Any], chosen: Sequence[int]) -> Pass:
    """(last hidden state, the chosen blocks' outputs in order, the model's pooler output if it has one)."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = model(x, **kwargs)
        hidden = out.hidden_states  # L+1 x [B, P + h*w, D]; [0] is the embedding output
        pooler = getattr(out, "pooler_output", None)
        return (hidden[-1], *(hidden[i + 1] for i in chosen), *(() if pooler is None else (pooler,)))

    return run


def up_to_blocks(
    model: torch.nn.Module, blocks: Sequence[torch.nn.Module], kwargs: dict[str, Any], wanted: Sequence[int]
) -> Pass:
    """The outputs of the ``wanted`` blocks (ascending), running no block after the deepest of them.

    Hooks rather than output_hidden_states on a shortened block list: transformers installs its own
    output-capturing hooks once, lazily, on the blocks it first sees, so mutating the model would corrupt
    every later full forward pass. Traced, the pass ends where the hook stops it."""
    deepest = wanted[-1]

    def run(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        captured: dict[int, torch.Tensor] = {}

        def capture(index: int) -> Callable[..., None]:
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                captured[index] = output[0] if isinstance(output, tuple) else output  # [B, P + h*w, D]
                if index == deepest:
                    raise StopForward  # nothing after this block is needed

            return hook

        handles = [blocks[i].register_forward_hook(capture(i)) for i in wanted]
        try:
            with contextlib.suppress(StopForward):
                model(x, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return tuple(captured[i] for i in wanted)

    return run
