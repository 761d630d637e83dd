"""Liveness on a real S3 server: writers and GCs on other hosts, alive but slow, then killed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cas.blobstore.base import BlobStore
from cas.errors import LockHeld
from cas.retention.gc import GCResult, GCSettings
from tests.gc_workers import state
from tests.helpers import assert_bit_exact
from tests.liveness_workers import SlowChunkWrites
from tests.retention_helpers import chunk_digests, reachable_chunks, renewal_threads
from tests.test_gc_s3 import s3_repo

pytestmark = pytest.mark.s3

NO_GRACE = GCSettings(grace=0, reflog_window=0)
ROOT = Path(__file__).resolve().parent.parent
LEASE = 4.0
MARGIN = 1.2
"""Short leases: S3 mtimes count whole seconds, so the margin stays above one."""
SLACK = 2.0
"""What the test's own polling and the store clock's whole seconds add to a lapse."""


def _elsewhere(role: str, *args: str) -> subprocess.Popen[str]:
    """A worker process that reports another host, so only time can tell that it died."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.liveness_workers", role, *args, "--elsewhere"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_live_writer_idle_past_its_lease_keeps_it_and_its_save_survives_gc_on_s3(
    s3_url: str,
) -> None:
    s3_repo(s3_url, leases={"duration": LEASE, "margin": MARGIN})
    slows: list[SlowChunkWrites] = []

    def slow(blobs: BlobStore) -> BlobStore:
        slows.append(SlowChunkWrites(blobs, delay=2 * LEASE, after=2))
        return slows[0]

    writer = s3_repo(s3_url, slow)
    done = threading.Event()
    results: list[GCResult] = []

    def gc_loop() -> None:
        gc_repo = s3_repo(s3_url)
        while not done.is_set():
            results.append(gc_repo.plan_gc(NO_GRACE).execute())

    gc = threading.Thread(target=gc_loop)
    gc.start()
    try:
        writer.save(state(5, 6), "w/slow")
    finally:
        done.set()
        gc.join()
    assert slows[0].waiting.is_set() and len(results) > 3
    repo = s3_repo(s3_url)
    assert_bit_exact(repo.load("w/slow"), state(5, 6))
    assert repo.verify(level="full").ok
    writer.close()
    assert renewal_threads() == []


def test_a_killed_remote_writer_is_protected_while_alive_and_lapses_within_its_lease_on_s3(
    s3_url: str,
) -> None:
    repo = s3_repo(s3_url, leases={"duration": LEASE, "margin": MARGIN})
    writer = _elsewhere("save", s3_url, "w/slow", "120")
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "saving\n"
        time.sleep(LEASE + MARGIN + 1)  # alive but idle for longer than a lease
        plan = repo.plan_gc(NO_GRACE)
        assert len(plan.live_leases) == 1 and plan.chunks == ()  # what it stored is spared
    finally:
        writer.kill()
        writer.wait()
    killed = time.monotonic()
    while repo.plan_gc(NO_GRACE).live_leases:
        assert time.monotonic() - killed < LEASE + MARGIN + SLACK, "a dead writer still protects"
        time.sleep(0.2)
    result = repo.plan_gc(NO_GRACE).execute()
    assert result.deleted_chunks >= 1 and result.reaped_leases == 1
    assert chunk_digests(repo) == reachable_chunks(repo) == set()


def test_a_killed_remote_gc_blocks_the_next_one_no_longer_than_its_lock_on_s3(
    s3_url: str,
) -> None:
    repo = s3_repo(s3_url, leases={"duration": LEASE, "margin": MARGIN})
    for i in range(12):
        repo.save(state(100 + i), f"junk/{i}")
        repo.rm(f"junk/{i}")
    repo.save(state(1), "kept")
    time.sleep(1.1)  # older than GC's cutoff: S3 mtimes count whole seconds
    gc = _elsewhere("gc", s3_url, "0.5")  # 36 deletions, one at a time: 18 s
    try:
        assert gc.stdout is not None and gc.stdout.readline() == "sweeping\n"
        time.sleep(LEASE + 1)  # the run outlasts its lock's duration: renewed, it keeps it
        with pytest.raises(LockHeld, match="gc by elsewhere"):
            repo.plan_gc(NO_GRACE)
    finally:
        gc.kill()
        gc.wait()
    killed = time.monotonic()
    while True:
        try:
            result = repo.plan_gc(NO_GRACE).execute()
            break
        except LockHeld:
            assert time.monotonic() - killed < LEASE + SLACK, "a dead GC still holds the lock"
            time.sleep(0.2)
    assert result.deleted_chunks + result.deleted_manifests >= 1
    assert chunk_digests(repo) == reachable_chunks(repo)
    assert_bit_exact(repo.load("kept"), state(1))
    assert repo.verify(level="full").ok
