"""``vitembed eval retrieval``: class retrieval on Fashion-MNIST through the real search path, checked against
brute force.

Gallery and query images are drawn (seeded, disjoint) from the 10,000-image test split of Debian's
``dataset-fashion-mnist`` (IDX files, gzip); a gallery item is relevant to a query when both have the same
class. The gallery is embedded with the backbone, written to a LanceDB table exactly as ``vitembed index
build`` writes one (exact search), and every query is ranked by that table. R@1, R@k (at least one relevant
item in the top k) and mAP (over the whole gallery ranking) come from LanceDB's rankings; the same metrics
and the top-k ids and scores are recomputed with numpy in float64 and must agree (scores to 1e-5 of the score
scale: 1 for cosine, the largest |score| for dot; ids in order except between equal scores), so the numbers
measure the features, not the store.
"""

from __future__ import annotations

import gzip
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vit_backbone.catalog.index_build import (
    METRICS,
    IndexOptions,
    IndexStoreError,
    connect,
    create_table,
    table_names,
)
from vit_backbone.catalog.index_search import SimilarityIndex
from vit_backbone.catalog.meta import CatalogMeta
from vit_backbone.errors import InvalidOptionError, VitEmbedError
from vit_backbone.retrieval import (
    RetrievalScores,
    l2_normalize,
    per_query_metrics,
    relevance_ranking,
    summarize,
)

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
IMAGES_FILE = "t10k-images-idx3-ubyte.gz"
LABELS_FILE = "t10k-labels-idx1-ubyte.gz"
CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"
)  # fmt: skip
# Tolerances relative to the score scale (1 for cosine; the largest |score| for dot, whose raw inner products
# of unnormalised features reach the thousands, where float32 itself only resolves ~1e-4)
SCORE_TOLERANCE = 1e-5
TIE_TOLERANCE = 1e-6  # two gallery items whose numpy scores differ by less are a tie: either order is right
METRIC_TOLERANCE = 1e-4  # float32 near-ties deep in a ranking may swap and move mAP in the 6th digit
TABLE = "fashion_mnist"


class DatasetMissingError(VitEmbedError):
    code = "dataset_missing"


@dataclass(frozen=True)
class EvalSpec:
    model: str = "embedded"
    pooling: str | None = None  # None: the model's default
    layers: list[int] | None = None
    policy: str | None = None
    size: tuple[int, ...] | None = None
    preset: str | None = None  # named defaults for the options not given (None: the model's current one)
    normalize: bool = False
    metric: str = "cosine"
    gallery: int = 1000
    queries: int = 500
    k: int = 10
    seed: int = 0
    batch_size: int = 16

    def __post_init__(self) -> None:
        if self.gallery < 1 or self.queries < 1 or self.gallery + self.queries > 10_000:
            raise InvalidOptionError(
                f"--gallery and --queries must be at least 1 and together at most 10000 (the test split), "
                f"got {self.gallery} + {self.queries}"
            )
        if not 1 <= self.k <= self.gallery:
            raise InvalidOptionError(f"--k must be from 1 to the gallery size {self.gallery}, got {self.k}")
        if self.size is not None and len(self.size) != 2:
            raise InvalidOptionError(f"--size takes H W, got {list(self.size)}")
        if self.metric not in METRICS:  # checked here, before minutes of embedding
            raise InvalidOptionError(f"--metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise InvalidOptionError(
                f"--batch-size must be a whole number of at least 1, got {self.batch_size!r}"
            )


@dataclass(frozen=True)
class FashionSplit:
    images: np.ndarray  # [G + Q, 28, 28] uint8: gallery rows first, then queries
    labels: np.ndarray  # [G + Q] class ids
    test_indices: np.ndarray  # [G + Q] positions in the 10,000-image test split
    gallery: int

    @property
    def ids(self) -> list[str]:
        return [f"fmnist-test-{int(i):05d}" for i in self.test_indices]


@dataclass(frozen=True)
class ParityCheck:
    """LanceDB's exact top-k against numpy's float64 brute force, query by query."""

    queries: int
    k: int
    same_ids: int  # queries whose top-k ids are identical, in order
    tie_swaps: int  # positions where the ids differ only between items of equal score
    id_mismatches: int  # positions where they differ otherwise
    max_score_diff: float
    score_tolerance: float  # SCORE_TOLERANCE x the score scale
    metrics_equal: bool  # R@1, R@k and mAP from both full rankings agree to METRIC_TOLERANCE

    @property
    def passed(self) -> bool:
        return self.id_mismatches == 0 and self.max_score_diff <= self.score_tolerance and self.metrics_equal

    def describe(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: LanceDB exact top-{self.k} == numpy brute force for {self.same_ids}/{self.queries} "
            f"queries (ids in the same order; {self.tie_swaps} swaps between equal scores, "
            f"{self.id_mismatches} other differences), max |score difference| {self.max_score_diff:.1e} "
            f"(tolerance {self.score_tolerance:.1e}), R@1/R@k/mAP "
            f"{'equal' if self.metrics_equal else 'DIFFERENT'} (to {METRIC_TOLERANCE:g})"
        )


@dataclass(frozen=True)
class EvalReport:
    spec: EvalSpec
    meta: CatalogMeta
    scores: RetrievalScores  # from LanceDB's rankings
    numpy_scores: RetrievalScores
    check: ParityCheck
    embed_s: float
    index_s: float
    search_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": asdict(self.spec),
            "meta": self.meta.to_dict(),
            "r1": self.scores.r1,
            f"r{self.spec.k}": self.scores.hit_at_k,
            "map": self.scores.map,
            "scores": self.scores.to_dict(),
            "numpy_scores": self.numpy_scores.to_dict(),
            "check": {**asdict(self.check), "passed": self.check.passed},
            "seconds": {"embed": self.embed_s, "index": self.index_s, "search": self.search_s},
        }


# ------------------------------------------------------------------------------------------- data
def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzip): two zero bytes, type 0x08 (unsigned byte), ndim, ndim big-endian sizes, data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08":
        raise DatasetMissingError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise DatasetMissingError(f"{path}: the header says {dims} but the file holds {data.size} values")
    return data.reshape(dims)


def load_fashion_mnist(gallery: int, queries: int, seed: int, folder: Path = FASHION_DIR) -> FashionSplit:
    paths = [folder / IMAGES_FILE, folder / LABELS_FILE]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DatasetMissingError(
            f"Fashion-MNIST is not installed ({', '.join(missing)} missing): "
            "apt-get install dataset-fashion-mnist (Debian/Ubuntu)"
        )
    images, labels = read_idx(paths[0]), read_idx(paths[1])  # [10000, 28, 28], [10000]
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise DatasetMissingError(f"{folder}: images {images.shape} and labels {labels.shape} do not match")
    chosen = np.random.default_rng(seed).permutation(len(labels))[: gallery + queries]  # disjoint split
    return FashionSplit(images[chosen], labels[chosen].astype(np.int64), chosen, gallery)


# ------------------------------------------------------------------------------------------- rankings
def numpy_similarities(queries: np.ndarray, gallery: np.ndarray, metric: str) -> np.ndarray:
    """[Q, G] float64 similarities, brute force."""
    if metric == "cosine":
        return l2_normalize(queries) @ l2_normalize(gallery).T
    return queries.astype(np.float64) @ gallery.astype(np.float64).T


def lancedb_rankings(
    index: SimilarityIndex, queries: np.ndarray, gallery_ids: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Every query's full ranking of the table by exact search: ([Q, G] positions in ``gallery_ids``,
    [Q, G] scores)."""
    position = {row_id: i for i, row_id in enumerate(gallery_ids)}
    rows = len(gallery_ids)
    orders = np.zeros((len(queries), rows), dtype=np.int64)
    scores = np.zeros((len(queries), rows), dtype=np.float64)
    for q, vector in enumerate(queries):
        hits = index.rank_all(vector)
        orders[q] = [position[h.id] for h in hits]
        scores[q] = [h.score for h in hits]
    return orders, scores


def compare_top_k(
    orders: np.ndarray, scores: np.ndarray, reference: np.ndarray, k: int, metrics_equal: bool
) -> ParityCheck:
    """LanceDB's top-k (row positions ``orders``, ``scores``) against the numpy similarities ``reference``."""
    scale = max(1.0, float(np.abs(reference).max()))
    expected = np.argsort(-reference, axis=1, kind="stable")[:, :k]  # [Q, k]
    got = orders[:, :k]
    same = (got == expected).all(axis=1)
    ties = mismatches = 0
    for q, p in zip(*np.nonzero(got != expected), strict=True):
        if abs(reference[q, got[q, p]] - reference[q, expected[q, p]]) <= TIE_TOLERANCE * scale:
            ties += 1
        else:
            mismatches += 1
    # the score LanceDB reports for each item it returned, against numpy's score for that same item
    own = np.take_along_axis(reference, got, axis=1)  # [Q, k]
    return ParityCheck(
        queries=len(orders),
        k=k,
        same_ids=int(same.sum()),
        tie_swaps=ties,
        id_mismatches=mismatches,
        max_score_diff=float(np.abs(scores[:, :k] - own).max()),
        score_tolerance=SCORE_TOLERANCE * scale,
        metrics_equal=metrics_equal,
    )


def _scores_from_ranking(relevant: np.ndarray, k: int, gallery: int) -> RetrievalScores:
    return summarize(per_query_metrics(relevant, k), k, gallery)


# ------------------------------------------------------------------------------------------- the run
def run_retrieval_eval(
    spec: EvalSpec, *, db: Path | None = None, folder: Path = FASHION_DIR, overwrite: bool = False
) -> EvalReport:
    """The evaluation; ``db`` keeps its table, refusing to replace an existing one unless ``overwrite``
    (checked before any embedding)."""
    from PIL import Image

    from vit_backbone.loading import load_backbone

    if db is not None and not overwrite and Path(db).is_dir() and TABLE in table_names(connect(db)):
        raise IndexStoreError(
            f"table {TABLE!r} already exists in {db}: give --overwrite to replace it, or another --db"
        )
    split = load_fashion_mnist(spec.gallery, spec.queries, spec.seed, folder)
    backbone = load_backbone(spec.model)
    images = [Image.fromarray(a).convert("RGB") for a in split.images]  # 28x28 grey → RGB
    started = time.perf_counter()
    result = backbone.embed_result(
        images,
        pooling=spec.pooling,  # type: ignore[arg-type]
        layers=spec.layers,
        size=None if spec.size is None else (spec.size[0], spec.size[1]),
        policy=spec.policy,  # type: ignore[arg-type]
        normalize=spec.normalize,
        batch_size=spec.batch_size,
        preset=spec.preset,
    )
    embed_s = time.perf_counter() - started
    vectors = result.vectors  # [G + Q, D]
    if vectors.ndim != 2:
        raise InvalidOptionError(
            f"pooling {result.pooling!r} gives {vectors.ndim - 1}-D features; use a pooled one"
        )
    meta = CatalogMeta(
        model=spec.model,
        revision=result.revision,
        preprocess_hash=result.preprocess_hash,
        pooling=result.pooling,
        layers=result.layers,
        size=None if result.size is None else list(result.size),
        policy=result.policy,
        normalized=spec.normalize,
        dim=int(vectors.shape[1]),
        dtype="float32",
        precision="float32",  # load_backbone's default: no autocast
        preset=result.preset,
    )
    g = split.gallery
    gallery, queries = vectors[:g], vectors[g:]  # [G, D], [Q, D]
    with tempfile.TemporaryDirectory(prefix="vitembed-eval-") as scratch:
        target = db if db is not None else Path(scratch) / "db"
        started = time.perf_counter()
        create_table(
            target,
            TABLE,
            split.ids[:g],
            gallery,
            meta,
            extra={"label": [CLASSES[int(c)] for c in split.labels[:g]]},
            options=IndexOptions(metric=spec.metric, ann_threshold=g + 1),  # type: ignore[arg-type]
            overwrite=True,
        )
        index_s = time.perf_counter() - started
        index = SimilarityIndex.open(target, TABLE)
        started = time.perf_counter()
        orders, scores = lancedb_rankings(
            index, queries, split.ids[:g]
        )  # [Q, G] gallery positions, best first
        search_s = time.perf_counter() - started
    gallery_labels, query_labels = split.labels[:g], split.labels[g:]
    reference = numpy_similarities(queries, gallery, spec.metric)  # [Q, G]
    from_lancedb = _scores_from_ranking(gallery_labels[orders] == query_labels[:, None], spec.k, g)
    from_numpy = _scores_from_ranking(relevance_ranking(reference, query_labels, gallery_labels), spec.k, g)
    metrics_equal = all(
        abs(getattr(from_lancedb, name) - getattr(from_numpy, name)) <= METRIC_TOLERANCE
        for name in ("r1", "hit_at_k", "map")
    )
    check = compare_top_k(orders, scores, reference, spec.k, metrics_equal)
    return EvalReport(spec, meta, from_lancedb, from_numpy, check, embed_s, index_s, search_s)


def format_report(report: EvalReport) -> str:
    spec, meta, s = report.spec, report.meta, report.scores
    size = "model default" if meta.size is None else f"{meta.size[0]}x{meta.size[1]}"
    images = spec.gallery + spec.queries
    return "\n".join(
        [
            f"Fashion-MNIST class retrieval: {spec.gallery} gallery / {spec.queries} query images of the "
            f"test split (seed {spec.seed}); relevant = same class",
            f"model {meta.model} (revision {meta.revision}, preprocess {meta.preprocess_hash})",
            f"features: pooling={meta.pooling} layers={meta.layers} policy={meta.policy} size={size} "
            f"normalized={meta.normalized} dim={meta.dim}; metric {spec.metric}, LanceDB exact search",
            f"R@1 {s.r1:.3f}   R@{spec.k} {s.hit_at_k:.3f}   mAP {s.map:.3f}   (P@{spec.k} {s.p_at_k:.3f})",
            f"numpy check: {report.check.describe()}",
            f"time: embed {report.embed_s:.1f} s ({images / max(report.embed_s, 1e-9):.1f} images/s), "
            f"index {report.index_s:.2f} s, search {report.search_s:.2f} s",
        ]
    )
