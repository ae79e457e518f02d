"""``vitembed embed-catalog`` with one test hook, for tests/vit_backbone/catalog/test_interrupt.py.

    python paused_job.py READY_FD GATE_FD embed-catalog ARGS...

The real command (its own signal handlers, its own commits), except that right after the first shard is
committed it writes one byte to READY_FD and then waits for one byte on GATE_FD. The test signals the
process only after READY and opens the gate only after the signal, so the job can neither finish before
the signal nor commit more before it: the order of events is fixed, not raced.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from vitembed.cli.main import main

from vit_backbone.catalog import local_engine


def _pause_after_first_shard(ready_fd: int, gate_fd: int) -> None:
    commit = local_engine.write_shard

    def write_shard(folder: Any, index: int, table: Any) -> None:
        commit(folder, index, table)
        if index == 0:
            os.write(ready_fd, b"1")
            os.read(gate_fd, 1)  # a signal arriving meanwhile runs its handler, then the read goes on

    local_engine.write_shard = write_shard  # type: ignore[assignment]


if __name__ == "__main__":
    _pause_after_first_shard(int(sys.argv[1]), int(sys.argv[2]))
    raise SystemExit(main(sys.argv[3:]))
