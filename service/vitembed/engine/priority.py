"""Thread priorities of a serving process (Linux keeps a nice value per thread).

The event loop reads every request head and answers every refusal. On a small machine it shares the cores
with forward threads that are always runnable, and each time it wakes it may wait behind them for a slice,
or be preempted while it holds the GIL, which every other Python thread then waits for. A lower nice value
for the event-loop thread alone lets it run as soon as a request arrives. It uses a small share of a core,
so the forward threads lose almost nothing; lowering the forward threads instead (``forward_nice``) hands a
neighbouring process a larger share of the machine.

A lower nice value needs CAP_SYS_NICE (root) or an RLIMIT_NICE that allows it (``--ulimit nice=25`` for a
container, ``LimitNICE=`` for a systemd unit); without it the process logs one line and keeps its
priority. A new thread starts at its creator's nice value, so every thread the threading module starts
after the raise (forward, decode, search, engine start, asyncio's and anyio's pools) first puts itself
back at the process's own value, through a one-shot ``threading.setprofile`` hook (a thread may always
raise its own nice value). Threads started from C are not covered: libuv's pool is
started before the raise, and torch's OpenMP team is never started from the event loop (the server runs
torch ops on worker threads)."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

_process_nice: int | None = None  # the value the process started at, once a thread was raised above it


def thread_nice(tid: int | None = None) -> int:
    """The nice value of thread ``tid`` (default: the calling thread)."""
    return os.getpriority(os.PRIO_PROCESS, tid if tid is not None else threading.get_native_id())


def raise_calling_thread(step: int) -> bool:
    """Lower the calling thread's nice value by ``step`` (> 0); False, with one log line, where the process
    may not (no CAP_SYS_NICE, RLIMIT_NICE too low) or the platform has no per-thread nice value."""
    global _process_nice
    if step <= 0:
        return False
    try:
        tid = threading.get_native_id()
        base = thread_nice(tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(-20, base - step))
    except (AttributeError, OSError) as exc:
        log.info(
            "event loop kept the process's priority (%s): a lower nice value needs CAP_SYS_NICE or "
            "an RLIMIT_NICE that allows it, e.g. --ulimit nice=%d",
            exc, 20 + step,
        )  # fmt: skip
        return False
    if _process_nice is None:
        _process_nice = base
        threading.setprofile(_reset_new_thread)  # every thread the threading module starts from now on
    log.info("event-loop thread at nice %d (the process's: %d)", thread_nice(tid), base)
    return True


def start_libuv_pool(host: str, port: int) -> None:
    """Start uvloop's thread pool (libuv's, process-wide: name resolution, file operations) from the calling
    thread, before it is raised: libuv starts its threads on first use, from the event loop, where they
    would inherit the event loop's priority. Nothing where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(loop.getaddrinfo(host, port))
    except OSError:
        pass  # an unresolvable host fails again, with its own message, when the server binds
    finally:
        loop.close()


def _reset_new_thread(frame: object, event: str, arg: object) -> None:
    """The profile hook of every thread the threading module starts after a raise (``threading.setprofile``):
    at the thread's first call, back to the process's nice value, then no profiling at all."""
    sys.setprofile(None)
    worker_thread_start()


def worker_thread_start() -> None:
    """Put the calling thread back at the process's nice value, where a thread above it created it; nothing
    otherwise."""
    if _process_nice is None:
        return
    try:
        tid = threading.get_native_id()
        if thread_nice(tid) < _process_nice:
            os.setpriority(os.PRIO_PROCESS, tid, _process_nice)
    except (AttributeError, OSError) as exc:  # raising one's own nice value is always allowed on Linux
        log.warning("worker thread priority not reset: %s", exc)
