"""The machine under the benches: CPU time per process, waiting for quiet, the bench lock, facts, RSS.

This VM has 2 cores shared with other sessions, so every measurement records the CPU that each process of
the bench used (the bench itself, the server, the load generator) and what everything else on the machine
used meanwhile (``background``: noise).
"""

from __future__ import annotations

import math
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK = Path("/tmp/vitembed_bench.lock")
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_line() -> list[int]:
    """The ``cpu`` line of /proc/stat: user nice system idle iowait irq softirq steal ... (ticks)."""
    return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def system_busy_seconds() -> float:
    """CPU-seconds all cores spent not idle since boot (/proc/stat)."""
    return system_cpu_seconds()[0]


def system_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU-seconds since boot from one read of /proc/stat: busy is every core's not-idle time
    (steal included), steal the time the hypervisor gave other guests while this VM's cores wanted to run."""
    values = _cpu_line()
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    steal = values[7] if len(values) > 7 else 0
    return (sum(values[:8]) - idle) / _TICK, steal / _TICK


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads; children it waited for not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def process_rss_bytes(pid: int) -> int:
    """Resident set size of a process now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class CpuWindow:
    """CPU use over a window, in cores (CPU-seconds per wall second): ``own`` (this process), each named
    process in ``pids`` (e.g. ``{"server": pid, "client": pid}``), and ``background``: everything else."""

    def __init__(self, pids: Mapping[str, int] | None = None) -> None:
        self.pids = dict(pids or {})
        self.wall = time.perf_counter()
        self.system = system_busy_seconds()
        self.own = time.process_time()
        self.start = {name: _cpu_or_zero(pid) for name, pid in self.pids.items()}

    def seconds(self) -> dict[str, float]:
        """CPU-seconds used since the window opened, per name, plus ``own`` and ``background``."""
        used = {name: _cpu_or_zero(pid) - self.start[name] for name, pid in self.pids.items()}
        used["own"] = time.process_time() - self.own
        used["background"] = max(0.0, system_busy_seconds() - self.system - sum(used.values()))
        return used

    def cores(self, wall: float | None = None) -> dict[str, float]:
        """Cores in use since the window opened (over ``wall`` seconds if given)."""
        elapsed = wall if wall is not None else time.perf_counter() - self.wall
        used = self.seconds()
        if elapsed <= 0:
            return {name: math.nan for name in used}
        return {name: value / elapsed for name, value in used.items()}


def _cpu_or_zero(pid: int) -> float:
    try:
        return process_cpu_seconds(pid)
    except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
        return 0.0


def wait_for_idle(max_busy_cores: float, max_wait_s: float) -> float:
    """Wait until the machine is quiet (other sessions' tests and benchmarks); returns the busy cores seen.
    ``max_wait_s`` <= 0 measures once and returns at once."""
    started = time.monotonic()
    while True:
        window = CpuWindow()
        time.sleep(3.0 if max_wait_s > 0 else 0.5)
        cores = window.cores()
        busy = cores["background"] + cores["own"]
        if busy <= max_busy_cores or max_wait_s <= 0:
            return busy
        if time.monotonic() - started > max_wait_s:
            print(f"warning: the machine is still busy ({busy:.2f} cores); numbers may be noisy", flush=True)
            return busy
        print(f"waiting for the machine to go quiet ({busy:.2f} cores busy) ...", flush=True)
        time.sleep(12.0)


@contextmanager
def bench_lock(name: str, *, enabled: bool = True) -> Iterator[None]:
    """Hold /tmp/vitembed_bench.lock while a full bench measures (waiting for another bench's lock first), so
    two benches never time each other. ``enabled=False`` (``--quick`` smoke runs, whose numbers mean
    nothing) skips it. SIGTERM exits through the ``finally`` so the lock is released."""
    if not enabled:
        yield
        return
    while True:
        try:
            fd = os.open(LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            holder = LOCK.read_text(errors="replace").strip() if LOCK.exists() else ""
            print(f"waiting for {LOCK} (held by {holder or 'another benchmark'})", flush=True)
            time.sleep(30)
    os.write(fd, f"{name} pid {os.getpid()}\n".encode())
    os.close(fd)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        LOCK.unlink(missing_ok=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info() -> dict[str, Any]:
    """Facts every report starts with: CPU, cores, library versions, load average at the time."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
