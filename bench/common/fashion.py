"""Fashion-MNIST samples for the heads benches (the Debian ``dataset-fashion-mnist`` IDX files, read by the
library's ``read_idx``: one copy of the reader)."""

from __future__ import annotations

import numpy as np

from vit_backbone.catalog.eval_retrieval import CLASSES, FASHION_DIR, read_idx

__all__ = ["CLASSES", "FASHION_DIR", "sample"]


def sample(split_name: str, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` images ([n, 28, 28] uint8) and labels ([n] int64) of ``train`` or ``t10k``, drawn by a
    seeded permutation."""
    if not FASHION_DIR.is_dir():
        raise RuntimeError(
            f"Fashion-MNIST is not installed ({FASHION_DIR}): apt-get install dataset-fashion-mnist"
        )
    images = read_idx(FASHION_DIR / f"{split_name}-images-idx3-ubyte.gz")  # [N, 28, 28] uint8
    labels = read_idx(FASHION_DIR / f"{split_name}-labels-idx1-ubyte.gz").astype(np.int64)  # [N]
    chosen = np.random.default_rng(seed).permutation(len(labels))[:count]
    return images[chosen], labels[chosen]
