"""The report of ``bench/overload.py``: ``overload.md`` (a table row per scenario) and ``overload.json``."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

COLUMNS = (
    "scenario",
    "neighbour",
    "load",
    "goodput /s",
    "capacity beside /s",
    "÷ capacity beside",
    "÷ block capacity",
    "÷ best probe",
    "p50 / p99 admitted s (sent in time)",
    "429 (p99 ms: in time / in time after the first second / early)",
    "504",
    "5xx",
    "loadgen cores",
    "server cores",
    "steal / other cores",
    "RSS before → after MiB",
)


def repeated(scenarios: list[dict[str, Any]]) -> list[str]:
    """A line per scenario played more than once in a block: its goodput over the capacity beside each play
    (mean, minimum, maximum, every play in order) and the 429 p99 after the first second (mean, maximum)."""
    plays: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for s in scenarios:
        plays.setdefault((s["scenario"], s["neighbour"]), []).append(s)
    lines = []
    for (name, busy), runs in plays.items():
        if len(runs) < 2:
            continue
        fractions = [r["fraction"] for r in runs]
        settled_known = [v for r in runs if not math.isnan(v := r.get("p99_429_settled_ms", math.nan))]
        lines.append(
            f"- {name}, {'busy' if busy else 'quiet'}, {len(runs)} plays: goodput ÷ capacity beside mean "
            f"**{statistics.fmean(fractions):.0%}** (min {min(fractions):.0%}, max {max(fractions):.0%}; "
            + ", ".join(f"{f:.0%}" for f in fractions)
            + "); 429 p99 after the first second "
            + (
                f"mean {statistics.fmean(settled_known):.0f} ms, max {max(settled_known):.0f} ms"
                if settled_known
                else "none"
            )
            + f"; 504 {sum(r['n_504'] for r in runs)}, 5xx {sum(r['n_5xx'] for r in runs)}"
        )
    return lines


def table_row(s: dict[str, Any], repeats: int = 1) -> str:
    recovery = f"; recovery {s['extra']['recovery_s']:.1f} s" if "recovery_s" in s["extra"] else ""
    if "server_after_stop" in s["extra"]:
        recovery += f" (server {s['extra']['server_after_stop']:.0%} in the 5 s after the stop)"
    if s["extra"].get("abandoned"):
        recovery += f"; {s['extra']['abandoned']} requests dropped by their callers at the stop"
    play = f" (play {s['extra'].get('play', 0) + 1})" if repeats > 1 else ""
    cells = (
        f"{s['scenario']}{play}{recovery}",
        "busy" if s["neighbour"] else "quiet",
        s["load"],
        f"{s['goodput']:.1f}",
        f"{s['extra'].get('capacity_beside', math.nan):.1f}",
        f"{s['fraction']:.0%}",
        f"{s['extra'].get('fraction_of_block', math.nan):.0%}",
        f"{s['extra'].get('fraction_of_best_probe', math.nan):.0%}",
        f"{s['p50_ok_s']:.2f} / {s['p99_ok_s']:.2f} ({s['p99_ok_in_time_s']:.2f})",
        f"{s['n_429']} ({s['p99_429_ms']:.0f} / {s.get('p99_429_settled_ms', math.nan):.0f} / "
        f"{s['p99_429_early_ms']:.0f})",
        str(s["n_504"]),
        str(s["n_5xx"]),
        f"{s['loadgen_cores']:.2f}",
        f"{s['server_cores']:.2f}",
        f"{s.get('steal_cores', math.nan):.2f} / {s.get('other_cores', math.nan):.2f}",
        f"{s['rss_before_mib']:.0f} → {s['rss_after_mib']:.0f}",
    )
    return "| " + " | ".join(cells) + " |"


def write_report(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    kind = "--quick (short scenarios: a smoke run)" if results["quick"] else "full"
    lines = [
        "# Overload benchmark (`bench/overload.py`)",
        "",
        f"Run: {results['when']}, {kind}"
        + (f", {results['scenario_s']:.0f} s per scenario" if "scenario_s" in results else "")
        + (f", C fixed at {results['clients_forced']} (--clients)" if "clients_forced" in results else "")
        + f"; server torch threads: {results.get('torch_threads') or 'default'}; "
        f"machine: {results['machine']}; load average before / after: "
        f"{results['load_before']} / {results['load_after']}"
        + (
            f"; server event-loop thread at nice {results['event_loop_nice']} (the process's: "
            f"{results['process_nice']})."
            if "event_loop_nice" in results
            else "."
        ),
        "",
        "Server: `vitembed serve` with the embedded backbone and server defaults (queue-delay target 2 s, "
        "request deadline 30 s); single-image multipart requests of 640x480 JPEGs of noise. The load "
        "generator is a separate process (asyncio, raw HTTP/1.1, keep-alive); 'busy' = one process spinning "
        "on one core for the whole block, capacity measured with it. 'steal / other cores': the VM's "
        "cores the hypervisor gave other guests, and CPU used by processes other than the server, the load "
        "generator and the neighbour, during the scenario (noise the run does not control).",
        "",
    ]
    for key, cap in results["capacity"].items():
        probes = ", ".join(f"{p['clients']}: {p['images_per_s']:.1f}/s" for p in cap["probes"])
        if "references" in cap:
            refs = cap["references"]
            lines.append(
                f"- capacity ({key}): **{cap['images_per_s']:.1f} images/s** over the block, the mean of "
                f"{len(refs)} reference runs ({cap['reference_clients']} closed-loop clients for "
                f"{cap['reference_s']:.0f} s each; {sum(r['n_429'] for r in refs)} × 429 in all), one before "
                "the first scenario and one after each: "
                + ", ".join(f"{r['images_per_s']:.1f}" for r in refs)
                + f"/s. Each scenario is judged against the mean of the two beside it. C = {cap['clients']} "
                + (
                    "clients (--clients)"
                    if "clients_forced" in results
                    else "clients, the fewest within 5 % of the best 12 s probe"
                )
                + f"; the best probe {cap['best_probe']:.1f}/s ({probes})"
            )
            continue
        if "before" not in cap:  # a run before the capacity runs: the best probe was the capacity
            lines.append(
                f"- capacity ({key}): **{cap['images_per_s']:.1f} images/s** with C = {cap['clients']} "
                f"clients ({probes})"
            )
            continue
        before, after = cap["before"], cap["after"]
        lines.append(
            f"- capacity ({key}): **{cap['images_per_s']:.1f} images/s**, the mean of "
            f"{before['images_per_s']:.1f}/s before the scenarios and {after['images_per_s']:.1f}/s after "
            f"them ({cap['reference_clients']} closed-loop clients for {cap['reference_s']:.0f} s each; "
            f"{before['n_429']} + {after['n_429']} × 429); C = {cap['clients']} clients, the fewest within "
            f"5 % of the best 12 s probe, {cap['best_probe']:.1f}/s ({probes})"
        )
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [table_row(s, results.get("repeats", 1)) for s in results["scenarios"]]
    summaries = repeated(results["scenarios"])
    if summaries:
        lines += ["", "Scenarios played more than once (each play between two capacity references):", ""]
        lines += summaries
    mem = results.get("memory")
    if mem:
        rss = mem["rss_mib"]
        statuses = {int(k): v for k, v in mem["statuses"].items()}  # JSON made the codes strings
        lines += [
            "",
            "Memory (tiny random-init model; mixed requests: 1-8 images of 64x64 to 640x480, pooling=patch "
            f"on some, an invalid image or option on others; statuses {statuses}): RSS at start "
            f"{rss['start']:.1f} MiB, after {mem['first']} requests {rss[str(mem['first'])]:.1f} MiB, "
            f"after {mem['requests']} requests {rss[str(mem['requests'])]:.1f} MiB: "
            f"**{mem['growth']:+.1%}**.",
        ]
    (out / "overload.md").write_text("\n".join(lines) + "\n")
