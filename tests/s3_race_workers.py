"""Child processes for the S3 race tests: a pusher that saves locally and pushes in a loop, and a
GC whose deletes are slow enough to be killed in the middle of a sweep."""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import cas
from cas.blobstore.base import BlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import LeaseExpired
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from tests.gc_workers import CHUNK, state

KEEP_LAST = 3
"""What the racing ``forget`` keeps of each pusher's checkpoints: the newest three."""
POOL = 6
"""Tensors each pusher draws its reused one from."""


def push_loop(local_dir: str, url: str, writer: int, seconds: float) -> dict[str, Any]:
    """Save ``w<writer>/ckpt_N`` in a local store and push it to ``url`` until time is up.

    After each push that reported success, the previous one (still among the newest
    ``KEEP_LAST``, so no forget may remove it) is verified in full on the remote: a reported
    push must keep every chunk. A push refused with LeaseExpired reported nothing and is counted
    apart. Returns the pushes and any problem found.
    """
    config = StoreConfig(chunk_size=CHUNK, inline_max=64)
    local = cas.open(local_dir, config=config, fsync=False)
    remote = cas.open(url, create=False)
    rng = random.Random(100 + writer)
    pushed: list[tuple[str, list[int]]] = []
    problems: list[str] = []
    refused = 0
    deadline = time.monotonic() + seconds
    index = 0
    while time.monotonic() < deadline:
        # One tensor from this pusher's own pool of 6: the refs kept name at most 3, so a push
        # often reuses a chunk GC is about to delete, and no other pusher heals a loss by
        # uploading it again before the check below.
        seeds = [1000 * (writer + 1) + rng.randrange(POOL), 2_000_000 * (writer + 1) + index]
        ref = f"w{writer}/ckpt_{index:05d}"
        index += 1
        local.save(state(*seeds), ref)
        try:
            local.push(remote, [ref], jobs=4)
        except LeaseExpired:
            refused += 1
            continue
        pushed.append((ref, seeds))
        if len(pushed) >= 2:
            previous, _ = pushed[-2]
            report = remote.verify([previous], level="full")
            if not report.ok:
                problems.extend(f"{previous}: {p}" for p in report.problems)
    local.close()
    remote.close()
    return {"pushed": pushed, "problems": problems, "refused": refused}


class SlowDelete(BlobStoreWrapper):
    """Deletes that each take ``delay`` seconds, so a sweep lasts long enough to be killed."""

    def __init__(self, inner: BlobStore, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def delete(self, key: str) -> None:
        time.sleep(self.delay)
        self.inner.delete(key)


def slow_gc(url: str, delay: float) -> None:
    """GC ``url`` with grace 0, each delete slowed by ``delay`` seconds."""
    opened = cas.open(url, create=False)
    repo = cas.Repository(SlowDelete(opened.blobs, delay), opened.config)
    repo.plan_gc(GCSettings(grace=0, reflog_window=0)).execute()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "gc":
        slow_gc(args[0], float(args[1]))
    else:
        local_arg, url_arg, writer_arg, seconds_arg, out_arg = args
        try:
            result = push_loop(local_arg, url_arg, int(writer_arg), float(seconds_arg))
        except Exception:
            result = {"pushed": [], "problems": [traceback.format_exc()], "refused": 0}
        Path(out_arg).write_text(json.dumps(result))
