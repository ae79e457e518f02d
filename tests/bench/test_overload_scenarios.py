"""Which scenarios a run of the overload bench plays (``--scenarios``, ``--repeats``, ``--blocks``), and the
report's line for a scenario played more than once."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.overload_report import repeated, table_row
from bench.overload_scenarios import SCENARIOS, scenario_load, select, select_blocks


def test_default_plays_every_scenario_once_in_order() -> None:
    assert select(None) == [(name, 0) for name in SCENARIOS]


def test_repeats_spread_the_plays_over_the_block() -> None:
    assert select("open loop 2x, closed 256", 3) == [
        ("open loop 2x", 0),
        ("closed 256", 0),
        ("open loop 2x", 1),
        ("closed 256", 1),
        ("open loop 2x", 2),
        ("closed 256", 2),
    ]


def test_names_holding_commas_are_selected_whole() -> None:
    assert select("16C leave, then C (recovery),open loop 2x, 16C then C (recovery)") == [
        ("16C leave, then C (recovery)", 0),
        ("open loop 2x", 0),
        ("16C then C (recovery)", 0),
    ]


@pytest.mark.parametrize(
    ("names", "repeats", "message"),
    [
        ("open loop", 1, "unknown scenario(s) ['open loop']: choose from 'closed 2C', "),
        ("", 1, "unknown scenario(s) ['']"),
        ("closed 256,closed 256", 1, "a scenario is named twice in 'closed 256,closed 256': use --repeats"),
        ("closed 256", 0, "--repeats must be at least 1, not 0"),
    ],
)
def test_bad_selections_are_refused_with_the_choices(names: str, repeats: int, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        select(names, repeats)
    assert str(caught.value).startswith(message)


def test_blocks() -> None:
    assert select_blocks(None) == [False, True]
    assert select_blocks(["busy"]) == [True]
    assert select_blocks(["busy", "quiet"]) == [False, True]  # quiet first, whatever the order asked
    assert select_blocks(["quiet", " busy"]) == [False, True]
    with pytest.raises(ValueError, match=r"unknown block\(s\) \['noisy'\]: choose from quiet, busy"):
        select_blocks(["noisy"])


def test_open_loop_load_is_twice_the_capacity_before_it() -> None:
    load, groups = scenario_load("open loop 2x", 16, 75.25, 30.0, 10.0)
    assert load == "150.5 req/s Poisson"
    assert [(g.rate, g.duration_s, g.clients) for g in groups] == [(150.5, 30.0, 0)]  # no closed-loop clients


def play(
    fraction: float, settled: float, busy: bool = True, n_504: int = 0, index: int = 0
) -> dict[str, Any]:
    return {
        "scenario": "open loop 2x",
        "neighbour": busy,
        "load": "150.0 req/s Poisson",
        "goodput": 75 * fraction,
        "fraction": fraction,
        "p50_ok_s": 1.9,
        "p99_ok_s": 3.0,
        "p99_ok_in_time_s": 2.2,
        "n_429": 2000,
        "p99_429_ms": 25.0,
        "p99_429_settled_ms": settled,
        "p99_429_early_ms": math.nan,
        "n_504": n_504,
        "n_5xx": 0,
        "loadgen_cores": 0.05,
        "server_cores": 1.4,
        "steal_cores": 0.0,
        "other_cores": 0.03,
        "rss_before_mib": 700.0,
        "rss_after_mib": 710.0,
        "extra": {"capacity_beside": 75.0, "play": index},
    }


def test_repeated_scenarios_get_their_mean_min_and_max() -> None:
    plays = [play(0.80, 20.0, n_504=1), play(0.95, 30.0, index=1), play(0.92, math.nan, index=2)]
    plays.append(play(1.0, 10.0, busy=False))  # played once: no line
    assert repeated(plays) == [
        "- open loop 2x, busy, 3 plays: goodput ÷ capacity beside mean **89%** (min 80%, max 95%; 80%, 95%, "
        "92%); 429 p99 after the first second mean 25 ms, max 30 ms; 504 1, 5xx 0"
    ]


def test_table_rows_name_the_play_only_when_repeated() -> None:
    assert table_row(play(0.9, 20.0), repeats=1).startswith("| open loop 2x | busy |")
    assert table_row(play(0.9, 20.0, index=1), repeats=3).startswith("| open loop 2x (play 2) | busy |")
    assert table_row(play(0.9, 20.0), repeats=3).startswith("| open loop 2x (play 1) | busy |")
