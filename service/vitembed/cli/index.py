"""Command-line adapters: ``vitembed index build|add|delete``, ``vitembed search`` and ``vitembed eval
retrieval``. Argument parsing and printing only; the work is in ``catalog.index``, ``catalog.search`` and
``catalog.eval_retrieval``, imported inside each run function so that ``vitembed --help`` stays instant and
works without the ``catalog`` extra."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from vit_backbone.catalog.index_defaults import DEFAULT_ANN_THRESHOLD
from vit_backbone.presets import DEFAULT_PRESET, PRESET_NAMES
from vitembed.cli.options import add_k, add_layers, add_server, add_size


def _quiet_lance() -> None:
    """Lance logs notices such as "No existing dataset ... it will be created" at WARN on stderr; a command
    line prints its own outcome, so only lance's errors are shown (unless LANCE_LOG says otherwise)."""
    os.environ.setdefault("LANCE_LOG", "error")


def _db_table(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, type=Path, help="LanceDB database folder")
    parser.add_argument("--table", required=True, help="table name inside it")


# --------------------------------------------------------------------------------------------- index
def configure_index(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build",
        help="create a table from a catalog folder (exact search; an ANN index past --ann-threshold rows)",
    )
    build.add_argument(
        "catalog", type=Path, metavar="CATALOG_DIR", help="written by `vitembed embed-catalog`"
    )
    _db_table(build)
    build.add_argument(
        "--metric",
        choices=("cosine", "dot"),
        default="cosine",
        help="cosine (default; score = cosine similarity in [-1, 1]) or dot (score = inner product); "
        "equal for --normalize catalogs",
    )
    build.add_argument(
        "--ann-threshold",
        type=int,
        default=DEFAULT_ANN_THRESHOLD,
        metavar="ROWS",
        help="build an IVF-PQ index once the table holds this many rows "
        f"(default {DEFAULT_ANN_THRESHOLD:,}); below it every search is exact",
    )
    build.add_argument("--overwrite", action="store_true", help="replace an existing table of that name")
    add = actions.add_parser("add", help="upsert a catalog's rows by id (same embedding options only)")
    add.add_argument("catalog", type=Path, metavar="CATALOG_DIR")
    _db_table(add)
    delete = actions.add_parser("delete", help="delete rows by id or by a SQL predicate")
    _db_table(delete)
    delete.add_argument("ids", nargs="*", metavar="ID", help="ids to delete")
    delete.add_argument("--where", help="SQL predicate on the metadata columns, e.g. \"brand = 'acme'\"")


def run_index(args: argparse.Namespace) -> int:
    _quiet_lance()
    from vit_backbone.catalog.index_build import IndexReport, add_catalog, build_index, delete_rows

    report: IndexReport
    if args.action == "build":
        report = build_index(
            args.catalog,
            args.db,
            args.table,
            metric=args.metric,
            ann_threshold=args.ann_threshold,
            overwrite=args.overwrite,
        )
        what = f"table built from {report.inserted} catalog rows"
    elif args.action == "add":
        report = add_catalog(args.catalog, args.db, args.table)
        what = f"{report.inserted} rows inserted, {report.updated} updated"
    else:
        report = delete_rows(args.db, args.table, ids=list(args.ids), where=args.where)
        what = f"{report.deleted} rows deleted"
    print(f"{report.db}:{report.table}: {what}; it holds {report.rows} rows, {_search_kind(report)}")
    return 0


def _search_kind(report: Any) -> str:
    if report.ann_built:
        return "searched through the ANN index (IVF-PQ) built now"
    if report.ann:
        return "searched through its ANN index (IVF-PQ)"
    return "searched exactly (no ANN index below the --ann-threshold)"


# --------------------------------------------------------------------------------------------- search
def configure_search(parser: argparse.ArgumentParser) -> None:
    _db_table(parser)
    parser.add_argument("images", nargs="*", type=Path, metavar="IMAGE", help="query image files")
    parser.add_argument(
        "--vector-file", type=Path, help=".npy query vector [D] or vectors [Q, D] instead of images"
    )
    add_k(parser, 10, "results per query (1..1000)")
    parser.add_argument("--where", help="SQL predicate on the metadata columns, applied before the search")
    parser.add_argument(
        "--model",
        help="the checkpoint that embedded the table (needed unless it is 'embedded'); its revision and "
        "preprocessing must match the table's",
    )
    add_server(
        parser,
        "embed the query images on a running `vitembed serve` (e.g. http://127.0.0.1:8000) serving the "
        "table's model, instead of loading the model here",
    )
    parser.add_argument("--exact", action="store_true", help="bypass the ANN index (exact search)")
    parser.add_argument(
        "--nprobes",
        type=int,
        help="IVF partitions an ANN search visits (default: 10%% of the partitions, at least 20); more is "
        "slower and closer to exact",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run_search(args: argparse.Namespace) -> int:
    _quiet_lance()

    from vit_backbone.catalog.index_build import check_where
    from vit_backbone.catalog.index_search import (
        SimilarityIndex,
        check_k,
        check_nprobes,
        embed_queries,
        load_query_backbone,
    )
    from vit_backbone.errors import InvalidOptionError

    if bool(args.images) == bool(args.vector_file):
        raise InvalidOptionError("give query IMAGE files or --vector-file (one of them)")
    check_k(args.k)
    check_nprobes(args.nprobes)
    if args.where is not None:
        check_where(args.where)
    index = SimilarityIndex.open(args.db, args.table)
    labels: list[str]
    if args.vector_file:
        vectors = load_vector_file(args.vector_file)  # [Q, D]
        labels = [f"{args.vector_file}[{i}]" for i in range(len(vectors))]
    elif args.server:
        from vitembed.cli.remote import query_vectors

        vectors = query_vectors(
            args.server, index.meta, [path.read_bytes() for path in args.images], api_key=args.api_key
        )  # [Q, D]
        labels = [str(path) for path in args.images]
    else:
        backbone = load_query_backbone(index.meta, args.model)
        vectors = embed_queries(backbone, index.meta, [path.read_bytes() for path in args.images])  # [Q, D]
        labels = [str(path) for path in args.images]
    results = [index.search(v, args.k, args.where, exact=args.exact, nprobes=args.nprobes) for v in vectors]
    if args.json:
        payload: dict[str, Any] = {
            "index": index.describe(),
            "queries": [
                {"query": label, "results": [hit.to_dict() for hit in hits]}
                for label, hits in zip(labels, results, strict=True)
            ],
        }
        json.dump(payload, sys.stdout, indent=2)
        print()
        return 0
    for label, hits in zip(labels, results, strict=True):
        print(f"{label}  ({index.metric}, {len(hits)} results)")
        for rank, hit in enumerate(hits, 1):
            extra = "  ".join(f"{k}={v}" for k, v in hit.metadata.items())
            print(f"  {rank:>3}  {hit.score:+.6f}  {hit.id}" + (f"  {extra}" if extra else ""))
    return 0


def load_vector_file(path: Path) -> Any:
    """A .npy file of one query [D] or several [Q, D], as numbers; anything else is a one-line error
    (pickled objects are never loaded: a .npy from elsewhere must not run code)."""
    import numpy as np

    from vit_backbone.errors import InvalidOptionError

    try:
        with open(path, "rb") as handle:
            magic = handle.read(6)
    except OSError as exc:
        raise InvalidOptionError(f"--vector-file {path} cannot be read ({exc.strerror})") from exc
    if magic != b"\x93NUMPY":
        raise InvalidOptionError(f"--vector-file {path} is not a .npy file (write one with numpy.save)")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise InvalidOptionError(
            f"--vector-file {path} is not a readable .npy array of numbers ({reason})"
        ) from exc
    if not isinstance(loaded, np.ndarray) or loaded.dtype.kind not in "fiu" or loaded.ndim not in (1, 2):
        raise InvalidOptionError(
            f"--vector-file {path} must hold one numeric .npy array of shape [D] or [Q, D]"
        )
    return loaded[None] if loaded.ndim == 1 else loaded  # [Q, D]


# --------------------------------------------------------------------------------------------- eval
def configure_eval(parser: argparse.ArgumentParser) -> None:
    tasks = parser.add_subparsers(dest="task", metavar="TASK", required=True)
    retrieval = tasks.add_parser(
        "retrieval",
        help="R@1, R@10 and mAP of class retrieval on Fashion-MNIST through a LanceDB table, checked "
        "against a brute-force numpy search",
    )
    retrieval.add_argument("--data", choices=("fashion-mnist",), default="fashion-mnist")
    retrieval.add_argument("--model", default="embedded", help="checkpoint folder, hub id or 'embedded'")
    retrieval.add_argument("--pooling", help="default: the model's")
    add_layers(retrieval, "0-based blocks, negative from the end (default: the model's)")
    retrieval.add_argument(
        "--policy", help="crop | squash | pad | dynamic | trim_squash | trim_pad (default: the preset's)"
    )
    retrieval.add_argument(
        "--preset", choices=PRESET_NAMES, help=f"named defaults for the options not given ({DEFAULT_PRESET})"
    )
    add_size(retrieval)
    retrieval.add_argument("--metric", choices=("cosine", "dot"), default="cosine")
    retrieval.add_argument("--normalize", action="store_true", help="L2-normalise the embeddings")
    retrieval.add_argument("--gallery", type=int, default=1000, help="gallery images (default 1000)")
    retrieval.add_argument("--queries", type=int, default=500, help="query images (default 500)")
    retrieval.add_argument("--k", type=int, default=10, help="R@k and the checked top-k (default 10)")
    retrieval.add_argument("--seed", type=int, default=0, help="which test images are drawn (default 0)")
    retrieval.add_argument("--batch-size", type=int, default=16)
    retrieval.add_argument(
        "--db", type=Path, help="keep the LanceDB table in this folder (default: temporary)"
    )
    retrieval.add_argument(
        "--overwrite", action="store_true", help="replace the table already in --db (refused otherwise)"
    )
    retrieval.add_argument("--json", action="store_true", help="print the report as JSON")


def run_eval(args: argparse.Namespace) -> int:
    _quiet_lance()
    from vit_backbone.catalog.eval_retrieval import EvalSpec, format_report, run_retrieval_eval

    layers = list(args.layers) if args.layers else None
    spec = EvalSpec(
        model=args.model,
        pooling=args.pooling,
        layers=layers,
        policy=args.policy,
        size=args.size,
        preset=args.preset,
        normalize=args.normalize,
        metric=args.metric,
        gallery=args.gallery,
        queries=args.queries,
        k=args.k,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    report = run_retrieval_eval(spec, db=args.db, overwrite=args.overwrite)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.check.passed else 1
