"""Similar-item search speed and ANN recall: a LanceDB table of N random-clustered vectors built through
``vit_backbone.catalog.index_build.create_table`` (IVF-PQ past the threshold), queried through
``SimilarityIndex.search``.

Measures the build time (rows + IVF-PQ training), exact and ANN query latency (median and p95 over the
queries, one at a time), and recall@k of ANN against the exact search for queries that are *not* rows of the
table (a row finds itself trivially), at the default nprobes and a few others.

    python -m bench.search_bench            # 100,000 x 384, 200 queries; ~2-4 min on 2 cores
    python -m bench.search_bench --rows 20000 --queries 50
    python -m bench.search_bench --quick    # 2,000 x 64, 20 queries, into a temporary folder

Holds /tmp/vitembed_bench.lock while it runs (waits for another benchmark's lock first; not with --quick).
Results go to bench/results/search.json and search.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("LANCE_LOG", "error")

from bench.common.machine import bench_lock, machine_info
from bench.common.report import add_output_options, output_dir, quick_note, write_report
from vit_backbone.catalog.index_build import IndexOptions, ann_partitions, create_table
from vit_backbone.catalog.index_search import SimilarityIndex, default_nprobes
from vit_backbone.catalog.meta import CatalogMeta


@dataclass
class SearchResults:
    quick: bool
    rows: int
    dim: int
    clusters: int
    queries: int
    k: int
    partitions: int
    ann_built: bool
    build_s: float
    exact: dict[str, float]
    ann: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)


def clustered(rng: np.random.Generator, rows: int, dim: int, clusters: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows around ``clusters`` random centres (spread 1 around centres of norm ~2*sqrt(dim)), and centres."""
    centers = 2.0 * rng.standard_normal((clusters, dim)).astype(np.float32)  # [C, D]
    labels = rng.integers(0, clusters, rows)
    return (centers[labels] + rng.standard_normal((rows, dim)).astype(np.float32)), centers  # [N, D]


def percentiles(values: list[float]) -> dict[str, float]:
    array = np.asarray(values) * 1000.0
    return {
        "median_ms": round(float(np.median(array)), 2),
        "p95_ms": round(float(np.percentile(array, 95)), 2),
    }


def timed_searches(
    index: SimilarityIndex, queries: np.ndarray, k: int, **options: Any
) -> tuple[list[set[str]], list[float]]:
    """Each query alone: the ids found and the seconds it took."""
    found, times = [], []
    for query in queries:
        started = time.perf_counter()
        hits = index.search(query, k, **options)
        times.append(time.perf_counter() - started)
        found.append({h.id for h in hits})
    return found, times


def measure(args: argparse.Namespace) -> SearchResults:
    rng = np.random.default_rng(0)
    vectors, centers = clustered(rng, args.rows, args.dim, args.clusters)  # [N, D], [C, D]
    labels = rng.integers(0, args.clusters, args.queries)
    queries = centers[labels] + rng.standard_normal((args.queries, args.dim)).astype(np.float32)  # [Q, D]
    meta = CatalogMeta("synthetic", "r0", "p0", "cls", None, None, "crop", False, args.dim, "float32")
    ids = [str(i) for i in range(args.rows)]
    with tempfile.TemporaryDirectory(prefix="search-bench-") as scratch:
        started = time.perf_counter()
        options = IndexOptions("cosine", ann_threshold=1)
        report = create_table(Path(scratch) / "db", "t", ids, vectors, meta, options=options)
        build_s = time.perf_counter() - started
        index = SimilarityIndex.open(Path(scratch) / "db", "t")
        index.search(queries[0], args.k)  # warm caches
        exact_ids, exact_times = timed_searches(index, queries, args.k, exact=True)
        default = default_nprobes(args.rows)
        runs = []
        for nprobes in sorted({default, 5, 2 * default, 4 * default}):
            found, times = timed_searches(index, queries, args.k, nprobes=nprobes)
            hits = sum(len(truth & got) for truth, got in zip(exact_ids, found, strict=True))
            runs.append(
                {
                    "nprobes": nprobes,
                    "default": nprobes == default,
                    f"recall@{args.k}": round(hits / (args.k * args.queries), 4),
                    **percentiles(times),
                }
            )
    return SearchResults(
        quick=args.quick,
        rows=args.rows,
        dim=args.dim,
        clusters=args.clusters,
        queries=args.queries,
        k=args.k,
        partitions=ann_partitions(args.rows),
        ann_built=report.ann_built,
        build_s=round(build_s, 1),
        exact=percentiles(exact_times),
        ann=runs,
        machine=machine_info(),
    )


def render(r: SearchResults) -> str:
    m = r.machine
    lines = [
        "# Similar-item search: LanceDB exact vs IVF-PQ",
        "",
        *quick_note(r.quick),
        f"`python -m bench.search_bench` — {r.rows:,} random-clustered vectors x {r.dim} "
        f"({r.clusters} clusters), cosine, {r.partitions} IVF partitions, refine factor 10; "
        f"{r.queries} queries that are not rows; {m['cpu']}, {m['cores']} CPUs, Python {m['python']}, "
        f"load average at start {m['load_average']}.",
        "",
        f"Build (rows + IVF-PQ training): **{r.build_s} s**. "
        f"Exact search: median {r.exact['median_ms']} ms, p95 {r.exact['p95_ms']} ms.",
        "",
        f"| nprobes | recall@{r.k} vs exact | median ms | p95 ms |",
        "|---|---|---|---|",
    ]
    for run in r.ann:
        label = f"{run['nprobes']} (default)" if run["default"] else str(run["nprobes"])
        lines.append(f"| {label} | {run[f'recall@{r.k}']} | {run['median_ms']} | {run['p95_ms']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.search_bench", description=__doc__.split("\n\n")[0]
    )
    add_output_options(parser)
    parser.add_argument("--rows", type=int, default=None, help="default 100,000 (--quick 2,000)")
    parser.add_argument("--dim", type=int, default=None, help="default 384 (--quick 64)")
    parser.add_argument("--clusters", type=int, default=None, help="default 1000 (--quick 20)")
    parser.add_argument("--queries", type=int, default=None, help="default 200 (--quick 20)")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args(argv)
    for name, full, quick in (
        ("rows", 100_000, 2_000),
        ("dim", 384, 64),
        ("clusters", 1000, 20),
        ("queries", 200, 20),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    out = output_dir(args, "search")
    with bench_lock("search_bench", enabled=not args.quick):
        results = measure(args)
    write_report(out, "search", results, render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
