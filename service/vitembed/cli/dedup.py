"""``vitembed dedup CATALOG_DIR --out DUPS``: near-duplicate groups of an embedded catalog (library:
``vit_backbone.catalog.dedup``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELP = "near-duplicate groups of an embedded catalog (connected components above a cosine threshold)"


def configure_dedup(parser: argparse.ArgumentParser) -> None:
    from vit_backbone.catalog.dedup import DEFAULT_BLOCK, PRESET_THRESHOLDS

    parser.add_argument(
        "catalog",
        type=Path,
        metavar="CATALOG_DIR",
        help="written by `vitembed embed-catalog`, or a LanceDB database with --table",
    )
    parser.add_argument(
        "--table",
        default=None,
        help="read this LanceDB table (`vitembed index build`) of the database CATALOG_DIR",
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="Parquet file: group, id, similarity_to_representative"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="cosine similarity joining two images (default: the one calibrated on bench/copy_detection.py "
        "for the preset that made the catalog, "
        + ", ".join(f"{k} {v}" for k, v in PRESET_THRESHOLDS.items())
        + "; other models or options: the current default's, uncalibrated: give your own)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=DEFAULT_BLOCK,
        help="rows compared per matrix product (memory: block x N)",
    )


def run_dedup(args: argparse.Namespace) -> int:
    from vit_backbone.catalog.dedup import (
        catalog_meta,
        default_threshold,
        find_duplicates,
        load_catalog_vectors,
        load_table_vectors,
        table_meta,
        write_duplicates,
    )

    started = time.perf_counter()
    if args.table is not None:
        ids, vectors = load_table_vectors(args.catalog, args.table)
        meta = table_meta(args.catalog, args.table)
    else:
        ids, vectors = load_catalog_vectors(args.catalog)
        meta = catalog_meta(args.catalog)
    threshold, source = (args.threshold, "given") if args.threshold is not None else default_threshold(meta)
    found = find_duplicates(vectors, threshold, block=args.block)
    summary = write_duplicates(
        found, ids, args.out, source=str(args.catalog), rows=len(ids), threshold_source=source
    )
    summary["seconds"] = round(time.perf_counter() - started, 2)
    json.dump(summary, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0
