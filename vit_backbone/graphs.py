"""Forward passes as TorchScript graphs: run without the GIL, so that several can run side by side.

Why: an eager forward pass takes the GIL back after every torch op (~300 per pass of DINOv2-S), so any
other Python thread of the process (a server's event loop, its decode workers) stalls it; and two eager
passes in two threads mostly wait for each other. A traced, frozen graph runs all its ops in C++ with the
GIL released. Measured on 2 cores (README, "Engine"): two graphs side by side with one torch thread each
served 92 images/s against 72 for one eager pass with two threads, and beside a Python thread holding the
GIL 30 % of the time 84 against 48, because one core's stall no longer stops the other at an OpenMP
barrier.

A graph is specialised to what it was traced with: the patch grid (position table), the requested blocks
and the autocast dtype; the batch size stays free. So a graph is keyed by those, traced the ``trace_after``-th
time its key is seen (sizes seen once, e.g. under ``policy='dynamic'``, stay eager), checked against the
eager pass on the same input before use, and kept in a small LRU: frozen graphs hold their own folded
constants (the bfloat16 weights: ~45 MB per graph for DINOv2-S). A key whose trace fails, whose graph
does not match the eager pass, or whose graph was dropped from the LRU is not traced again (sizes taking
turns past the slots stay eager rather than re-traced on every turn). Letterboxed batches (a per-batch
attention mask and position boxes) always run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)

GRAPH_SLOTS = 4  # graphs kept per backbone (least recently used dropped first)
TRACE_AFTER = 2  # a key is traced the 2nd time it is seen
# a graph is used only when it matches the eager pass on its trace input within this, relative to the
# largest eager value (frozen graphs fold the same casts the eager pass makes: measured 0.0 on DINOv2-S)
GRAPH_TOLERANCE = 1e-4

Outputs = tuple[torch.Tensor, ...]
Trace = Callable[[torch.Tensor], Outputs]  # the eager function a graph is traced from


class ForwardGraphs:
    """Traced graphs of one backbone, by key. Building happens under the caller's lock (tracing runs the
    eager model, hooks included); running a built graph takes no lock."""

    def __init__(self, *, slots: int = GRAPH_SLOTS, trace_after: int = TRACE_AFTER) -> None:
        if slots < 1 or trace_after < 1:
            raise ValueError("slots and trace_after must be at least 1")
        self.slots = slots
        self.trace_after = trace_after
        self._graphs: OrderedDict[Hashable, torch.jit.ScriptModule] = OrderedDict()
        self._seen: Counter[Hashable] = Counter()
        self._failed: set[Hashable] = set()
        self._lock = threading.Lock()
        self.traced = 0  # graphs built, ever (a dropped key traced again counts again)

    def get(self, key: Hashable) -> torch.jit.ScriptModule | None:
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
            return graph

    def wanted(self, key: Hashable) -> bool:
        """Count one sighting of ``key``; whether it should be traced now."""
        with self._lock:
            if key in self._failed or key in self._graphs:
                return False
            self._seen[key] += 1
            if len(self._seen) > 64 * self.slots:  # sizes seen once under a dynamic policy
                self._seen = Counter(dict(self._seen.most_common(8 * self.slots)))
            return self._seen[key] >= self.trace_after

    def build(
        self,
        key: Hashable,
        model: torch.nn.Module,
        eager: Trace,
        example: torch.Tensor,
        autocast: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> Outputs | None:
        """Trace ``eager`` on ``example`` under ``autocast()``, check it and keep it; the eager outputs
        for ``example`` (None if tracing itself failed, and the caller runs eagerly)."""
        previous = torch._C._jit_set_autocast_mode(False)  # the trace records the casts autocast makes
        try:
            with torch.no_grad(), autocast(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tracer's warnings about Python values it froze
                module = _Traced(model, eager)
                graph = torch.jit.freeze(torch.jit.trace(module, example, check_trace=False).eval())
                expected = eager(example)
                got = _as_tuple(graph(example))
        except Exception as exc:  # a family the tracer cannot follow stays eager
            log.warning("forward graph %s not traced, running eagerly: %s", key, exc)
            with self._lock:
                self._failed.add(key)
            return None
        finally:
            torch._C._jit_set_autocast_mode(previous)
        if not _matches(expected, got):
            log.warning("forward graph %s differs from the eager pass; running eagerly", key)
            with self._lock:
                self._failed.add(key)
            return expected
        with self._lock:
            self._graphs[key] = graph
            self.traced += 1
            while len(self._graphs) > self.slots:
                dropped, _ = self._graphs.popitem(last=False)
                self._failed.add(dropped)  # sizes taking turns past the slots are not traced over and over
        return expected

    def forward(
        self,
        key: Hashable,
        model: torch.nn.Module,
        eager: Trace,
        x: torch.Tensor,
        autocast: Callable[[], contextlib.AbstractContextManager[object]],
        lock: threading.Lock,
    ) -> Outputs | None:
        """``eager(x)``'s outputs from ``key``'s graph, built now if its time has come; None: run eagerly.
        A built graph runs without ``lock``; tracing holds it (it runs the eager model, hooks included)."""
        graph = self.get(key)
        if graph is not None:
            with autocast():
                return _as_tuple(graph(x))
        if not self.wanted(key):
            return None
        with lock:
            return self.build(key, model, eager, x, autocast)

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def failed(self) -> int:
        return len(self._failed)


class _Traced(torch.nn.Module):
    """The eager function as a module that owns ``model``: its weights become the graph's attributes
    (folded by ``freeze``), not free tensors the tracer would refuse."""

    def __init__(self, model: torch.nn.Module, eager: Trace) -> None:
        super().__init__()
        self.model = model
        self._eager = eager

    def forward(self, pixel_values: torch.Tensor) -> Outputs:
        return self._eager(pixel_values)


def _as_tuple(out: torch.Tensor | Sequence[torch.Tensor]) -> Outputs:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _matches(expected: Outputs, got: Outputs) -> bool:
    if len(expected) != len(got):
        return False
    for want, have in zip(expected, got, strict=True):
        if want.shape != have.shape or want.dtype != have.dtype:
            return False
        scale = max(1.0, float(want.float().abs().max()))
        if float((want.float() - have.float()).abs().max()) > GRAPH_TOLERANCE * scale:
            return False
    return True
