"""Reading Prometheus text exposition in tests."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$")


def sum_samples(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total
