"""Writers for the GC concurrency tests: save in a loop, keep the last two, check before removing."""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import cas
from cas.errors import LeaseExpired
from tests.retention_helpers import tensor

CHUNK = 4096
SHARED = 12
"""Tensors every writer draws from: they keep going unreachable and being reused."""


def state(*seeds: int) -> dict[str, Any]:
    """One 2-chunk tensor per seed."""
    return {f"t{i}": tensor(s, 2 * CHUNK) for i, s in enumerate(seeds)}


def writer_loop(
    store: str, writer: int, seconds: float, clock_offset: float = 0.0
) -> dict[str, Any]:
    """Save ``w<writer>/ckpt_N`` until time is up, removing all but the newest two.

    Before removing a checkpoint it re-reads it: a checkpoint whose save reported success must
    have every chunk for as long as its ref exists. A save refused with LeaseExpired reported
    nothing and is counted apart. ``clock_offset`` sets the writer's clock that far off (a host
    whose clock is wrong). Returns the saves and any problem found.
    """
    local: dict[str, Any] = {} if "://" in store else {"fsync": False}
    repo = cas.open(store, create=False, clock=lambda: time.time() + clock_offset, **local)
    rng = random.Random(writer)
    saved: list[tuple[str, list[int]]] = []
    problems: list[str] = []
    refused = 0
    deadline = time.monotonic() + seconds
    index = 0
    while time.monotonic() < deadline:
        seeds = [*rng.sample(range(SHARED), 2), 1_000_000 * (writer + 1) + index]
        ref = f"w{writer}/ckpt_{index:05d}"
        try:
            repo.save(state(*seeds), ref)
        except LeaseExpired:
            refused += 1
            index += 1
            continue
        saved.append((ref, seeds))
        if len(saved) > 2:
            old, _ = saved[-3]
            report = repo.verify([old], level="full")
            if not report.ok:
                problems.extend(str(p) for p in report.problems)
            repo.rm(old)
        index += 1
    repo.close()
    return {"saved": saved, "problems": problems, "refused": refused}


if __name__ == "__main__":
    store_arg, writer_arg, seconds_arg, out_arg = sys.argv[1:5]
    offset_arg = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    try:
        result = writer_loop(store_arg, int(writer_arg), float(seconds_arg), offset_arg)
    except Exception:
        result = {"saved": [], "problems": [traceback.format_exc()]}
    Path(out_arg).write_text(json.dumps(result))
