"""Similar-item search speed and ANN recall: a LanceDB table of N random-clustered vectors built through
``catalog.index.create_table`` (IVF-PQ past the threshold), queried through ``SimilarityIndex.search``.

Measures the build time (rows + IVF-PQ training), exact and ANN query latency (median and p95 over the
queries, one at a time), and recall@k of ANN against the exact search for queries that are *not* rows of the
table (a row finds itself trivially), at the default nprobes and a few others.

    python bench/search_bench.py            # 100,000 x 384, 200 queries; ~2-4 min on 2 cores
    python bench/search_bench.py --rows 20000 --queries 50

Holds /tmp/vitembed_bench.lock while it runs (waits for another benchmark's lock first). Results go to
bench/results/search.json and search.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("LANCE_LOG", "error")

from vit_backbone.catalog.index_build import (  # noqa: E402
    IndexOptions,
    ann_partitions,
    create_table,
)
from vit_backbone.catalog.index_search import SimilarityIndex, default_nprobes  # noqa: E402
from vit_backbone.catalog.meta import CatalogMeta  # noqa: E402

LOCK = Path("/tmp/vitembed_bench.lock")
RESULTS = ROOT / "bench" / "results"


def take_lock() -> None:
    while True:
        try:
            fd = os.open(LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            print(f"waiting for {LOCK} ({LOCK.read_text().strip() if LOCK.exists() else ''})", flush=True)
            time.sleep(30)
            continue
        os.write(fd, f"search_bench pid {os.getpid()}\n".encode())
        os.close(fd)
        return


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    take_lock()
    try:
        rng = np.random.default_rng(0)
        vectors, centers = clustered(rng, args.rows, args.dim, args.clusters)
        labels = rng.integers(0, args.clusters, args.queries)
        queries = centers[labels] + rng.standard_normal((args.queries, args.dim)).astype(np.float32)  # [Q, D]
        meta = CatalogMeta("synthetic", "r0", "p0", "cls", None, None, "crop", False, args.dim, "float32")
        ids = [str(i) for i in range(args.rows)]
        with tempfile.TemporaryDirectory(prefix="search-bench-") as scratch:
            started = time.perf_counter()
            report = create_table(
                Path(scratch) / "db", "t", ids, vectors, meta, options=IndexOptions("cosine", ann_threshold=1)
            )
            build_s = time.perf_counter() - started
            index = SimilarityIndex.open(Path(scratch) / "db", "t")
            index.search(queries[0], args.k)  # warm caches
            exact_ids, exact_times = [], []
            for query in queries:
                started = time.perf_counter()
                hits = index.search(query, args.k, exact=True)
                exact_times.append(time.perf_counter() - started)
                exact_ids.append({h.id for h in hits})
            default = default_nprobes(args.rows)
            runs = []
            for nprobes in sorted({default, 5, 2 * default, 4 * default}):
                found, times = 0, []
                for query, truth in zip(queries, exact_ids, strict=True):
                    started = time.perf_counter()
                    hits = index.search(query, args.k, nprobes=nprobes)
                    times.append(time.perf_counter() - started)
                    found += len(truth & {h.id for h in hits})
                runs.append(
                    {
                        "nprobes": nprobes,
                        "default": nprobes == default,
                        f"recall@{args.k}": round(found / (args.k * args.queries), 4),
                        **percentiles(times),
                    }
                )
        result = {
            "rows": args.rows,
            "dim": args.dim,
            "clusters": args.clusters,
            "queries": args.queries,
            "k": args.k,
            "partitions": ann_partitions(args.rows),
            "ann_built": report.ann_built,
            "build_s": round(build_s, 1),
            "exact": percentiles(exact_times),
            "ann": runs,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        }
    finally:
        LOCK.unlink(missing_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Similar-item search: LanceDB exact vs IVF-PQ",
        "",
        f"`python bench/search_bench.py` — {args.rows:,} random-clustered vectors x {args.dim} "
        f"({args.clusters} clusters), cosine, {result['partitions']} IVF partitions, refine factor 10; "
        f"{args.queries} queries that are not rows; {result['machine']}.",
        "",
        f"Build (rows + IVF-PQ training): **{result['build_s']} s**. "
        f"Exact search: median {result['exact']['median_ms']} ms, p95 {result['exact']['p95_ms']} ms.",
        "",
        f"| nprobes | recall@{args.k} vs exact | median ms | p95 ms |",
        "|---|---|---|---|",
    ]
    for run in runs:
        label = f"{run['nprobes']} (default)" if run["default"] else str(run["nprobes"])
        lines.append(f"| {label} | {run[f'recall@{args.k}']} | {run['median_ms']} | {run['p95_ms']} |")
    (args.out / "search.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
