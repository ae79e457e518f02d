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
    from vit_backbone.catalog.dedup import DEFAULT_BLOCK, DEFAULT_THRESHOLD

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
        default=DEFAULT_THRESHOLD,
        help=f"cosine similarity joining two images (default {DEFAULT_THRESHOLD}: calibrated for the "
        "embedded default features on bench/copy_detection.py; calibrate again for other models or poolings)",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=DEFAULT_BLOCK,
        help="rows compared per matrix product (memory: block x N)",
    )


def run_dedup(args: argparse.Namespace) -> int:
    from vit_backbone.catalog.dedup import (
        find_duplicates,
        load_catalog_vectors,
        load_table_vectors,
        write_duplicates,
    )

    started = time.perf_counter()
    if args.table is not None:
        ids, vectors = load_table_vectors(args.catalog, args.table)
    else:
        ids, vectors = load_catalog_vectors(args.catalog)
    found = find_duplicates(vectors, args.threshold, block=args.block)
    summary = write_duplicates(found, ids, args.out, source=str(args.catalog), rows=len(ids))
    summary["seconds"] = round(time.perf_counter() - started, 2)
    json.dump(summary, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0
