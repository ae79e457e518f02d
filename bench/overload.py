"""Overload: does ``vitembed serve`` keep its goodput when far more clients come than it can serve?

The operator's setup of issue 12: ``vitembed serve`` with the embedded default backbone and server defaults,
single-image multipart requests of 640x480 JPEGs of noise (the worst case for decoding). The load
generator is a separate process (``bench/overload_loadgen.py``: asyncio, raw HTTP/1.1 on keep-alive
connections, so that its own CPU stays small; that CPU is measured and reported, since it shares the
machine's cores).

Scenarios, each also with a busy neighbour (one process spinning on one core for the whole scenario, the
capacity then measured with it):

1. capacity: probes of closed-loop clients 1, 2, 4, 8, 16 and 32 (every one: a probe that stopped once the
   rate did not rise was fooled by one slow probe at 4 clients on a VM whose speed drifts); C is the fewest
   clients within 5 % of the best probe. The capacity itself is measured by reference runs as long as a
   scenario, with the clients of the best probe: one before the block's first scenario and one after each
   scenario, so that every scenario lies between two of them. A scenario is judged against the mean of
   the two beside it: the VM's speed drifts by 5-15 % over a block's quarter hour, more than the margin
   the goodput bar leaves, so one capacity for the whole block misjudges its first and last scenarios.
   Each goodput is also reported over the block's capacity (the mean of all its reference runs) and over
   the best probe (the best of six 12 s probes overstates what the server sustains);
2. overload: 2C, 4C, 16C and 256 closed-loop clients that ignore ``Retry-After`` (or the overload would
   vanish), and a well-behaved run (16C clients that wait ``Retry-After``);
3. open loop: Poisson arrivals at twice the capacity, each on its own connection;
4. recovery: right after the 16C overload stops, C clients: seconds until their goodput over a 1 s window
   is back at 90 % of capacity, twice: once with the flood's callers gone at the stop (each closes its
   connection and drops the request it has in flight: the overload is over), once with them waiting for
   the answers to the requests they sent before it (the server held most of those until their
   Retry-After, and serves them first: callers refused earlier are let back earlier). Beside each, the
   server's own goodput (every client's) over the 5 s after the stop.

Reported per scenario: goodput (200s within the deadline per second) as a fraction of capacity, p50/p99 of
admitted requests, p99 of 429 answers (from request start), 504s, 5xx, the load generator's CPU, the
server's RSS before and after. A request sent on a connection before the ``Retry-After`` of its last 429 had
passed is "early": the server holds it until then (``enforce_retry_after``), so the 429 and admitted
latencies are also reported for the requests sent in time alone, and the 429s of requests sent in time
after the first second of a scenario apart (at its start every closed-loop client connects and sends its
first body in the same instant). Then memory: RSS after 1,000 and after
10,000 requests (mixed sizes and counts, some invalid) on a tiny random-init model (so the run takes a
minute; growth is the server's).

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.overload [--quick] [--seconds S] [--clients C]
        [--torch-threads N] [--scenarios NAMES] [--repeats N] [--blocks quiet,busy] [--out DIR]

``--scenarios``, ``--repeats`` and ``--blocks`` play some scenarios, several times each
(``bench/overload_scenarios.py``): one 30 s play moves by 10-20 % between runs on this VM.

Writes ``overload.md`` and ``overload.json`` into ``bench/results``; ``--quick`` shortens every scenario (a
smoke run, not numbers to quote) and writes into a temporary folder unless ``--out`` names one. A full run
holds the bench lock (``bench.common.machine.bench_lock``) and first waits for a quiet machine.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common.machine import bench_lock, system_cpu_seconds, wait_for_idle
from bench.common.report import add_output_options, output_dir
from bench.overload_loadgen import ABANDONED, Group, Record, jpeg_noise, multipart_request
from bench.overload_memory import memory_suite
from bench.overload_processes import cpu_seconds, neighbour, rss_mib, run_loadgen, server
from bench.overload_report import write_report
from bench.overload_scenarios import SCENARIOS, scenario_load, select, select_blocks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TORCH_THREADS: int | None = None  # --torch-threads: the server's (default: its own choice)
DEADLINE_S = 30.0  # the server's default request_timeout_s: a 200 after it is not goodput
# closed-loop clients of the capacity probes: up to 32, since a forward pass takes up to 16 of the default
# preset's images and 16 clients (two thirds of them decoding or in transit at any moment) do not fill it
CAPACITY_CLIENTS = (1, 2, 4, 8, 16, 32)
RAMP_S = 1.0  # the start of a window, when all clients connect and send at once: 429 latency reported apart


# ------------------------------------------------------------------------------------------- summaries
def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class Summary:
    scenario: str
    neighbour: bool
    load: str
    duration_s: float
    goodput: float  # 200s within the deadline, completed inside the window, per second
    # of the capacity under the same conditions: the mean of the reference runs just before and just after it
    fraction: float
    p50_ok_s: float
    p99_ok_s: float
    rate_429: float
    p99_429_ms: float  # of requests sent in time (not before their connection's last Retry-After)
    p99_429_early_ms: float  # of requests sent early (held by a server that enforces Retry-After)
    # of requests sent in time once the first RAMP_S of the window had passed: at the start every closed-loop
    # client opens its connection and sends its first 276 kB body in the same instant
    p99_429_settled_ms: float
    n_early: int  # requests sent early
    p99_ok_in_time_s: float  # admitted requests that were sent in time
    n_200: int
    n_429: int
    n_504: int
    n_5xx: int
    n_other: int
    loadgen_cores: float
    server_cores: float
    # the VM's cores taken by the hypervisor for other guests (/proc/stat steal), and CPU used by any
    # process other than the server, the load generator and the neighbour: noise the run cannot control
    steal_cores: float
    other_cores: float
    rss_before_mib: float
    rss_after_mib: float
    extra: dict[str, Any] = field(default_factory=dict)


def summarise(
    name: str,
    with_neighbour: bool,
    load: str,
    records: list[Record],
    window: tuple[float, float],
    capacity: float,
    loadgen_cpu: float,
    server_cpu: float,
    rss: tuple[float, float],
    group: str | None = None,
    machine_cpu: tuple[float, float] = (math.nan, math.nan),
) -> Summary:
    mine = [r for r in records if group is None or r.group == group]
    start, end = window
    span = end - start
    ok = [r for r in mine if r.status == 200]
    good = [r for r in ok if r.end - r.start <= DEADLINE_S and start <= r.end <= end]
    refused = [r for r in mine if r.status == 429]
    goodput = len(good) / span
    return Summary(
        scenario=name,
        neighbour=with_neighbour,
        load=load,
        duration_s=span,
        goodput=goodput,
        fraction=goodput / capacity if capacity else math.nan,
        p50_ok_s=pct([r.end - r.start for r in ok], 50),
        p99_ok_s=pct([r.end - r.start for r in ok], 99),
        rate_429=len(refused) / span,
        p99_429_ms=1000 * pct([r.end - r.start for r in refused if not r.early], 99),
        p99_429_early_ms=1000 * pct([r.end - r.start for r in refused if r.early], 99),
        p99_429_settled_ms=1000
        * pct([r.end - r.start for r in refused if not r.early and r.start >= start + RAMP_S], 99),
        n_early=sum(r.early for r in mine),
        p99_ok_in_time_s=pct([r.end - r.start for r in ok if not r.early], 99),
        n_200=len(ok),
        n_429=len(refused),
        n_504=sum(r.status == 504 for r in mine),
        n_5xx=sum(r.status >= 500 and r.status != 504 for r in mine),
        n_other=sum(r.status not in (200, 429, ABANDONED) and r.status < 500 for r in mine),
        loadgen_cores=loadgen_cpu / max(r.end for r in records) if records else math.nan,
        server_cores=server_cpu / max(r.end for r in records) if records else math.nan,
        steal_cores=machine_cpu[0],
        other_cores=machine_cpu[1],
        rss_before_mib=rss[0],
        rss_after_mib=rss[1],
    )


def scenario(
    proc: subprocess.Popen[bytes],
    port: int,
    payloads: list[bytes],
    name: str,
    with_neighbour: bool,
    load: str,
    groups: list[Group],
    capacity: float,
    seed: int = 0,
    neighbour_pid: int | None = None,
) -> tuple[Summary, list[Record]]:
    rss_before, cpu_before = rss_mib(proc.pid), cpu_seconds(proc.pid)
    busy_before, steal_before = system_cpu_seconds()
    spin_before = cpu_seconds(neighbour_pid) if neighbour_pid else 0.0
    wall_before = time.monotonic()
    records, loadgen_cpu = run_loadgen(port, payloads, groups, seed)
    wall = time.monotonic() - wall_before
    rss_after, server_cpu = rss_mib(proc.pid), cpu_seconds(proc.pid) - cpu_before
    busy_after, steal_after = system_cpu_seconds()
    steal = steal_after - steal_before
    spin = (cpu_seconds(neighbour_pid) - spin_before) if neighbour_pid else 0.0
    # the bench process waits in subprocess.run meanwhile: what is left is other processes' CPU
    other = busy_after - busy_before - steal - server_cpu - loadgen_cpu - spin
    main = groups[0]
    summary = summarise(
        name,
        with_neighbour,
        load,
        records,
        (main.start_s, main.start_s + main.duration_s),
        capacity,
        loadgen_cpu,
        server_cpu,
        (rss_before, rss_after),
        group=main.name,
        machine_cpu=(steal / wall, max(0.0, other) / wall),
    )
    print(
        f"  {name:<28} {'busy' if with_neighbour else 'quiet':<5} goodput {summary.goodput:6.2f}/s "
        f"({summary.fraction:5.1%}) p50/p99 {summary.p50_ok_s:5.2f}/{summary.p99_ok_s:5.2f} s  "
        f"429 {summary.n_429} (p99 {summary.p99_429_ms:.0f} / settled {summary.p99_429_settled_ms:.0f} / "
        f"early {summary.p99_429_early_ms:.0f} ms)  "
        f"504 {summary.n_504}  5xx {summary.n_5xx}  "
        f"loadgen {summary.loadgen_cores:.2f} cores, steal {summary.steal_cores:.2f}, "
        f"other {summary.other_cores:.2f}",
        flush=True,
    )
    return summary, records


def recovery_seconds(
    records: list[Record], group: str, since: float, capacity: float, horizon: float
) -> float:
    """First time after ``since`` at which ``group``'s goodput over the next 1 s reaches 90 % of capacity."""
    ends = sorted(r.end for r in records if r.group == group and r.status == 200)
    t = since
    while t + 1.0 <= horizon:
        if sum(t <= e < t + 1.0 for e in ends) >= 0.9 * capacity:
            return t - since
        t += 0.1
    return math.inf


def goodput_fraction_after(records: list[Record], since: float, span: float, capacity: float) -> float:
    """Every client's 200s within the deadline that ended in ``[since, since + span)``, per second, over
    ``capacity``: whether the server itself serves at full rate right after an overload."""
    good = sum(
        r.status == 200 and r.end - r.start <= DEADLINE_S and since <= r.end < since + span for r in records
    )
    return good / span / capacity if capacity else math.nan


# ------------------------------------------------------------------------------------------- the run
def closed_rate(port: int, payloads: list[bytes], clients: int, duration: float) -> tuple[float, int]:
    """200s per second (completed inside the window) of ``clients`` closed-loop clients, and their 429s."""
    records, _ = run_loadgen(port, payloads, [Group("cap", clients=clients, duration_s=duration)])
    rate = sum(r.status == 200 and r.end <= duration for r in records) / duration
    return rate, sum(r.status == 429 for r in records)


def measure_capacity(
    proc: subprocess.Popen[bytes], port: int, payloads: list[bytes], with_neighbour: bool, duration: float
) -> tuple[float, int, int, list[dict[str, Any]]]:
    """(best probe, C, the clients of the best probe, the probes)."""
    tried: list[dict[str, Any]] = []
    for count in CAPACITY_CLIENTS:
        rate, _ = closed_rate(port, payloads, count, duration)
        tried.append({"clients": count, "images_per_s": rate})
        print(
            f"  capacity probe {'busy' if with_neighbour else 'quiet'}: {count:>2} clients {rate:6.2f}/s",
            flush=True,
        )
    best = max(t["images_per_s"] for t in tried)
    clients = min(t["clients"] for t in tried if t["images_per_s"] >= 0.95 * best)
    saturating = next(t["clients"] for t in tried if t["images_per_s"] == best)
    return best, clients, saturating, tried


def reference_capacity(
    port: int, payloads: list[bytes], clients: int, duration: float, when: str
) -> dict[str, Any]:
    """A capacity run as long as a scenario, with the clients of the best probe: the best of six short probes
    on a VM whose speed drifts by several percent is an upward-biased estimate of what the server sustains.
    One such run before a block's first scenario and one after each scenario; a scenario is judged against
    the mean of the two beside it."""
    rate, refused = closed_rate(port, payloads, clients, duration)
    print(
        f"  capacity {when}: {clients} clients for {duration:.0f} s: {rate:6.2f}/s ({refused} × 429)",
        flush=True,
    )
    return {"when": when, "images_per_s": rate, "n_429": refused}


def rebase(summary: Summary, beside: float, block: float, best_probe: float) -> None:
    """Goodput over the capacity beside the scenario (the bar), the block's and the best probe's."""
    summary.fraction = summary.goodput / beside if beside else math.nan
    summary.extra["capacity_beside"] = beside
    summary.extra["fraction_of_block"] = summary.goodput / block if block else math.nan
    summary.extra["fraction_of_best_probe"] = summary.goodput / best_probe if best_probe else math.nan


def overload_suite(
    model: str,
    out: Path,
    quick: bool,
    seconds: float | None = None,
    clients: int | None = None,
    plays: Sequence[tuple[str, int]] | None = None,
    blocks: Sequence[bool] = (False, True),
) -> dict[str, Any]:
    """``plays``: the scenarios each block plays, with their play indices (``overload_scenarios.select``;
    default: each once); ``blocks``: which blocks run, as ``with_neighbour`` flags."""
    plays = list(plays or select(None))
    duration = seconds or (8.0 if quick else 30.0)
    probe = 5.0 if quick else 12.0
    with (
        tempfile.TemporaryDirectory() as tmp,
        server(model, Path(tmp) / "serve.log", torch_threads=TORCH_THREADS) as (proc, port),
    ):
        payloads = [multipart_request(port, [jpeg_noise(640, 480, seed)]) for seed in range(16)]
        results: dict[str, Any] = {"scenarios": [], "capacity": {}, "scenario_s": duration}
        if clients:
            results["clients_forced"] = clients
        # the server's event-loop thread (its main thread) runs at a lower nice value where it may
        results["event_loop_nice"] = os.getpriority(os.PRIO_PROCESS, proc.pid)
        results["process_nice"] = os.getpriority(os.PRIO_PROCESS, 0)
        if any(play for _, play in plays):
            results["repeats"] = 1 + max(play for _, play in plays)
        for with_neighbour in blocks:
            with neighbour(with_neighbour) as spinner:
                best, c, saturating, tried = measure_capacity(proc, port, payloads, with_neighbour, probe)
                c = clients or c  # --clients: the floods' sizes fixed (the probes are still reported)
                key = "busy" if with_neighbour else "quiet"
                results["capacity"][key] = {"images_per_s": best, "clients": c, "probes": tried}
                if best <= 0:
                    print("  no request finished within a probe: the machine is too busy to measure")
                    continue
                refs = [reference_capacity(port, payloads, saturating, duration, "before the scenarios")]
                tail = 10.0  # the recovery scenario: C clients for this long once a 16C overload stops

                block: list[Summary] = []
                recovery_records: dict[int, list[Record]] = {}  # block index -> the scenario's records
                for name, play in plays:
                    load, groups = scenario_load(name, c, refs[-1]["images_per_s"], duration, tail)
                    summary, records = scenario(
                        proc,
                        port,
                        payloads,
                        name,
                        with_neighbour,
                        load,
                        groups,
                        refs[-1]["images_per_s"],  # the figures printed meanwhile
                        seed=play,
                        neighbour_pid=spinner,
                    )
                    summary.extra["play"] = play
                    block.append(summary)
                    if len(groups) > 1:
                        recovery_records[len(block) - 1] = records
                    refs.append(reference_capacity(port, payloads, saturating, duration, f"after {name}"))
                capacity = sum(r["images_per_s"] for r in refs) / len(refs)
                results["capacity"][key] = {
                    "images_per_s": capacity,
                    "clients": c,
                    "probes": tried,
                    "best_probe": best,
                    "reference_clients": saturating,
                    "reference_s": duration,
                    "references": refs,
                }
                for i, summary in enumerate(block):
                    beside = (refs[i]["images_per_s"] + refs[i + 1]["images_per_s"]) / 2
                    rebase(summary, beside, capacity, best)
                for index, records in recovery_records.items():
                    recovery = block[index]
                    beside = recovery.extra["capacity_beside"]
                    recovery.extra["recovery_s"] = recovery_seconds(
                        records, "after", duration, beside, duration + tail
                    )
                    recovery.extra["server_after_stop"] = goodput_fraction_after(
                        records, duration, 5.0, beside
                    )
                    recovery.extra["abandoned"] = sum(r.status == ABANDONED for r in records)
                print(
                    f"  {key}: capacity {capacity:.2f}/s (references "
                    + ", ".join(f"{r['images_per_s']:.1f}" for r in refs)
                    + f"; best probe {best:.2f}/s); goodput ÷ capacity beside: "
                    + ", ".join(f"{s.scenario} {s.fraction:.0%}" for s in block)
                    + "; recovery to 90 % of capacity: "
                    + ", ".join(
                        f"{block[i].scenario} {block[i].extra['recovery_s']:.1f} s (server's goodput in the "
                        f"5 s after the stop: {block[i].extra['server_after_stop']:.0%} of capacity)"
                        for i in recovery_records
                    ),
                    flush=True,
                )
                results["scenarios"] += [asdict(s) for s in block]
    return results


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_output_options(parser)
    parser.add_argument("--model", default="embedded=embedded", help="the served model (NAME=PATH_OR_ID)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="the server's torch threads (default: its own); 1 avoids OpenMP barriers on a crowded machine",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="each scenario's and each capacity reference run's length (default 30, --quick 8); longer "
        "windows average out more of a shared VM's second-to-second noise",
    )
    parser.add_argument(
        "--clients",
        type=positive_int,
        default=None,
        help="C in every block instead of the fewest clients within 5 %% of the best probe (the probes "
        "still run and are reported): --clients 32 makes the 16C floods 512 clients in both blocks",
    )
    parser.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated scenarios to play in each block (default: all): "
        + ", ".join(repr(s) for s in SCENARIOS),
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="play each chosen scenario this many times per block, each between two capacity references and "
        "with its own seed; the report adds each one's mean, minimum and maximum",
    )
    parser.add_argument(
        "--blocks", default="quiet,busy", help="which blocks to run: quiet, busy or both (default)"
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-overload", action="store_true")
    args = parser.parse_args()
    try:
        plays = select(args.scenarios, args.repeats)
        blocks = select_blocks(args.blocks.split(","))
    except ValueError as exc:
        parser.error(str(exc))
    out = output_dir(args, "overload")
    global TORCH_THREADS
    TORCH_THREADS = args.torch_threads

    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
        "torch_threads": args.torch_threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "scenarios": [],
        "capacity": {},
    }
    with bench_lock("overload", enabled=not args.quick):
        if not args.quick:
            wait_for_idle(0.3, 600)
            results["load_before"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        if not args.skip_overload:
            results.update(
                overload_suite(args.model, out, args.quick, args.seconds, args.clients, plays, blocks)
            )
        if not args.skip_memory:
            results["memory"] = memory_suite(args.quick, TORCH_THREADS)
    results["load_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    write_report(results, out)
    print(f"wrote {out / 'overload.md'}")


if __name__ == "__main__":
    main()
