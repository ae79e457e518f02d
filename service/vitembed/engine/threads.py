"""How a serving process spends its CPUs: forward threads per model, torch threads each, and the GIL
switch interval (``configure_threads``, once, when the engine starts)."""

from __future__ import annotations

import logging
import sys

import torch

from vit_backbone.cpu_quota import available_cpus
from vitembed.settings import ServiceSettings

log = logging.getLogger(__name__)


def forward_plan(settings: ServiceSettings, device: torch.device, cpus: int | None = None) -> tuple[int, int]:
    """(forward threads per model, torch threads). The usable CPUs come from affinity and the cgroup quota,
    not the host's core count torch sees by default (`--cpus 1` in a container -> 1 thread). On the CPU
    with graphs, the passes run side by side, one per CPU up to 4, and share the CPUs' torch threads; an
    eager pass takes the GIL back at every op, so eager passes, and passes on an accelerator, run one at
    a time with every CPU."""
    cpus = cpus or available_cpus()
    workers = settings.forward_workers
    if workers == 0:
        workers = min(cpus, 4) if settings.forward_graphs and device.type == "cpu" else 1
    threads = settings.torch_threads or max(1, cpus // workers)
    return workers, threads


def configure_threads(settings: ServiceSettings, device: torch.device) -> int:
    """Process-wide thread settings of a serving process: torch's intra-op threads (``forward_plan``) and the
    GIL switch interval, short so that an eager forward thread, which takes the GIL back after every torch
    op, does not wait behind the event loop. Returns the forward threads per model."""
    workers, threads = forward_plan(settings, device)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    log.info(
        "forward threads per model: %d, torch threads: %d (graphs %s); GIL switch interval %g ms",
        workers, threads, "on" if settings.forward_graphs else "off", settings.gil_switch_interval_ms,
    )  # fmt: skip
    return workers
