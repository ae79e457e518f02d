"""The scenarios of ``bench/overload.py``: their names, the load each puts on the server, and which of them
a run plays (``--scenarios``, ``--repeats``, ``--blocks``).

A full run plays every scenario once in each block (quiet, then beside the busy neighbour). A single 30 s
scenario on this VM moves by 10-20 % between runs of the same command (the capacity reference runs of one
block spread that wide), more than the margin of the goodput bar; ``--repeats N`` plays the chosen scenarios
N times each, every play between two capacity references and with its own seed (the open loop's Poisson
arrivals differ), and the report adds each scenario's mean, minimum and maximum over its plays.
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.overload_loadgen import Group

SCENARIOS = (
    "closed 2C",
    "closed 4C",
    "closed 16C",
    "closed 256",
    "well-behaved 16C",
    "open loop 2x",
    "16C leave, then C (recovery)",
    "16C then C (recovery)",
)


def scenario_load(name: str, c: int, rate: float, duration: float, tail: float) -> tuple[str, list[Group]]:
    """The load of one of ``SCENARIOS`` (its description and client groups); ``rate``: the capacity measured
    just before it, ``tail``: how long the recovery scenario's C clients run once its 16C overload stops."""
    if name == "closed 256":
        return "256 clients", [Group("main", clients=256, duration_s=duration)]
    if name.startswith("closed "):
        clients = int(name.split()[1].rstrip("C")) * c
        return f"{clients} clients", [Group("main", clients=clients, duration_s=duration)]
    if name == "well-behaved 16C":
        return f"{16 * c} clients, honour Retry-After", [
            Group("main", clients=16 * c, duration_s=duration, honour_retry_after=True)
        ]
    if name == "open loop 2x":
        return f"{2 * rate:.1f} req/s Poisson", [Group("main", rate=2 * rate, duration_s=duration)]
    leave = name.startswith("16C leave")
    return f"{16 * c} {'leave, ' if leave else ''}then {c} clients", [
        Group("main", clients=16 * c, duration_s=duration, leave_at_stop=leave),
        Group("after", clients=c, start_s=duration, duration_s=tail),
    ]


BLOCKS = ("quiet", "busy")


def select(names: str | None, repeats: int = 1) -> list[tuple[str, int]]:
    """The scenarios a block plays, in order, each with its play index (its load generator's seed):
    ``names`` is a comma-separated list of ``SCENARIOS`` (None: all), every one played ``repeats`` times,
    the list repeated as a whole so that a scenario's plays are spread over the block."""
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, not {repeats}")
    chosen, unknown = (list(SCENARIOS), []) if names is None else _split(names)
    if unknown or not chosen:
        raise ValueError(
            f"unknown scenario(s) {unknown or [names]}: choose from " + ", ".join(repr(s) for s in SCENARIOS)
        )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"a scenario is named twice in {names!r}: use --repeats to play it more than once")
    return [(name, play) for play in range(repeats) for name in chosen]


def _split(names: str) -> tuple[list[str], list[str]]:
    """(known names, unknown pieces) of a comma-separated list whose names may hold commas themselves
    ("16C leave, then C (recovery)"): pieces are joined until they make a known name."""
    chosen: list[str] = []
    pending = ""
    for piece in names.split(","):
        pending = f"{pending},{piece}" if pending else piece
        if pending.strip() in SCENARIOS:
            chosen.append(pending.strip())
            pending = ""
    return chosen, [pending.strip()] if pending.strip() else []


def select_blocks(names: Sequence[str] | None) -> list[bool]:
    """The blocks to run, as ``with_neighbour`` flags, quiet first."""
    chosen = list(BLOCKS) if not names else [n.strip() for n in names if n.strip()]
    unknown = [n for n in chosen if n not in BLOCKS]
    if unknown:
        raise ValueError(f"unknown block(s) {unknown}: choose from {', '.join(BLOCKS)}")
    return [name == "busy" for name in BLOCKS if name in chosen]
