"""Time and peak memory of ``find_duplicates`` on N x D float32 vectors (random, with planted near-duplicate
pairs whose recovery is checked), the figures in README "Near duplicates".

    python bench/dedup_bench.py [--rows 100000] [--dim 384] [--block 4096] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from vit_backbone.catalog.dedup import find_duplicates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--block", type=int, default=4096)
    parser.add_argument("--planted", type=int, default=1000, help="near-duplicate pairs planted")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rows = 5000 if args.quick else args.rows
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.dim)).astype(np.float32)  # [N, D]
    planted = min(args.planted, rows // 2)
    x[rows - planted :] = x[:planted] + 0.1 * rng.normal(size=(planted, args.dim)).astype(np.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    found = find_duplicates(x, 0.95, block=args.block)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "rows": rows,
        "dim": args.dim,
        "block": args.block,
        "seconds": round(seconds, 1),
        "peak_rss_mb": round(peak_mb),
        "rss_before_mb": round(before / 1024),
        "groups": int(found.group.max() + 1) if len(found.group) else 0,
        "planted": planted,
    }
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
