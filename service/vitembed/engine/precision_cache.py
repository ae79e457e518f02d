"""The ``--precision auto`` decision, cached on the cache volume so a restarted or rescheduled server skips
the probe (two timed passes over the warm-up images per model: seconds on a CPU with native bfloat16).

The key is what decides the answer, never the host name (a pod gets a new one at every start): the CPU's
instruction-set flags (or the CUDA device name), the torch version, the model's revision and preprocessing
hash, and the rule's inputs (setting, thresholds). A different machine class or model misses and measures
again; a corrupt or unreadable file is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from vit_backbone.precision import MIN_COSINE, SLOWER_VETO, PrecisionChoice, cpu_flags

log = logging.getLogger(__name__)
CACHE_FILE = "precision-decisions.json"


def decision_key(device: torch.device, revision: str, preprocess_hash: str, setting: str) -> str:
    """A short hash of everything the auto decision depends on."""
    if device.type == "cuda":
        hardware = f"cuda:{torch.cuda.get_device_name(device)}"
    else:
        hardware = "cpu:" + " ".join(sorted(cpu_flags()))
    parts = [
        hardware,
        torch.__version__,
        revision,
        preprocess_hash,
        setting,
        str(MIN_COSINE),
        str(SLOWER_VETO),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_decision(cache_dir: Path, key: str) -> PrecisionChoice | None:
    """The cached choice for ``key``, or None (absent, unreadable, or not a known precision)."""
    entry = _read(cache_dir / CACHE_FILE).get(key)
    if not isinstance(entry, dict) or entry.get("label") not in ("float32", "bfloat16", "float16"):
        return None
    label = str(entry["label"])
    cosine = entry.get("min_cosine")
    dtype = None if label == "float32" else getattr(torch, label)
    return PrecisionChoice(dtype=dtype, label=label, min_cosine=float(cosine) if cosine is not None else None)


def store_decision(cache_dir: Path, key: str, choice: PrecisionChoice) -> None:
    """Add ``choice`` under ``key`` (atomic replace; a read-only volume only logs)."""
    path = cache_dir / CACHE_FILE
    data = _read(path)
    data[key] = {"label": choice.label, "min_cosine": choice.min_cosine, "seconds": choice.seconds}
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".precision-", suffix=".json")
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        log.info("precision decision not cached in %s: %s", cache_dir, exc)
