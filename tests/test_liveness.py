"""Liveness: a live writer keeps its lease however idle, a dead one stops protecting soon, and the
fences left for dead writers go away (local and memory stores; tests/test_liveness_s3.py on S3)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cas
from cas.blobstore import MemoryBlobStore
from cas.blobstore.base import BytesLike, Version
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import BackendError, LeaseExpired, LockHeld
from cas.model.manifest import Manifest
from cas.model.state import encode_state
from cas.names import RefName
from cas.refs.fences import FENCE_INDEX
from cas.refs.keys import ref_key
from cas.refs.leases import LeaseManager, LeaseSettings
from cas.refs.maintenance import MAINTENANCE_LOCK_KEY, MaintenanceService
from cas.retention.gc import GCResult, GCSettings
from tests.gc_workers import state
from tests.helpers import assert_bit_exact
from tests.liveness_workers import SlowChunkWrites
from tests.retention_helpers import FakeClock, FrozenWriter, local_repo, renewal_threads

NO_GRACE = GCSettings(grace=0, reflog_window=0)
ROOT = Path(__file__).resolve().parent.parent


def test_a_live_writer_idle_past_its_lease_keeps_it_and_its_save_survives_gc(
    tmp_path: Path,
) -> None:
    base = local_repo(tmp_path, leases={"duration": 2.0, "margin": 0.3})
    slow = SlowChunkWrites(base.blobs, delay=5.0, after=2)  # idle for 2.5 leases mid-save
    writer = cas.Repository(slow, base.config)
    done = threading.Event()
    results: list[GCResult] = []
    renewing: list[int] = []

    def gc_loop() -> None:
        gc_repo = local_repo(tmp_path)
        while not done.is_set():
            results.append(gc_repo.plan_gc(NO_GRACE).execute())
            renewing.append(len(renewal_threads("lease")))
            time.sleep(0.05)

    gc = threading.Thread(target=gc_loop)
    gc.start()
    try:
        writer.save(state(5, 6), "w/slow")
    finally:
        done.set()
        gc.join()
    assert slow.waiting.is_set() and len(results) > 10
    assert max(renewing) == 1  # the save's lease was being renewed while it waited
    assert_bit_exact(writer.load("w/slow"), state(5, 6))
    assert writer.verify(level="full").ok
    assert renewal_threads() == []  # none left behind by the save or by GC's lock
    left_open = writer.writer_lease("a file left open for writing")
    assert left_open is not None and len(renewal_threads("lease")) == 1
    writer.close()
    assert renewal_threads() == [] and not list(base.blobs.list("leases/"))
    with pytest.raises(LeaseExpired):
        left_open.check()


def test_a_lease_renewal_that_returns_too_late_loses_the_lease_for_good() -> None:
    clock = FakeClock(1000.0)

    class SlowLeaseWrite(BlobStoreWrapper):
        """The next lease write takes 70 s: it may land after GC found the lease expired."""

        slow = False

        def put_transient(self, key: str, data: BytesLike) -> None:
            self.inner.put_transient(key, data)
            if self.slow:
                self.slow = False
                clock.advance(70)

    blobs = SlowLeaseWrite(MemoryBlobStore(clock))
    leases = LeaseManager(blobs, clock, LeaseSettings(duration=100, margin=20))
    lease = leases.acquire("slow link")
    assert lease is not None
    clock.advance(30)
    blobs.slow = True
    with pytest.raises(LeaseExpired, match=r"returned at 1100\.000, after the lease it extended"):
        lease.refresh()  # issued at 1030, safely live until 1080, returned at 1100
    with pytest.raises(LeaseExpired):
        lease.refresh()  # a timely write does not revive it
    with pytest.raises(LeaseExpired, match="commit aborted"):
        lease.check()
    lease.release()
    assert renewal_threads("lease") == []


def test_a_writer_whose_renewals_fail_is_told_why_its_lease_ran_out() -> None:
    class LeaseWritesFail(MemoryBlobStore):
        down = False

        def put_transient(self, key: str, data: BytesLike) -> None:
            if self.down:
                raise BackendError(f"S3 PutObject {key}: connection reset")
            super().put_transient(key, data)

    blobs = LeaseWritesFail()
    leases = LeaseManager(blobs, time.time, LeaseSettings(duration=0.4, margin=0.1))
    with leases.hold("save") as lease:
        assert lease is not None
        blobs.down = True
        time.sleep(0.6)  # renewals every 0.1 s, all failing
        with pytest.raises(LeaseExpired, match="renewing the lease failed: S3 PutObject leases/"):
            lease.check()
    assert renewal_threads() == []


def test_a_dead_remote_writer_and_gc_stop_blocking_within_minutes_by_default() -> None:
    clock = FakeClock(1000.0)
    blobs = MemoryBlobStore(clock)
    writers = LeaseManager(blobs, clock, LeaseSettings())
    service = MaintenanceService(blobs, clock, writers)
    lease = writers.acquire("a writer on a host that lost power")
    assert lease is not None
    held = service.lock("gc")
    held.__enter__()
    clock.advance(100)  # no renewal since (their threads wait 30 s): as if both hosts were gone
    assert [s.live for s in service.lease_states()] == [True]
    with pytest.raises(LockHeld), service.lock("gc"):
        pass
    clock.advance(2.5 * 60 - 100)  # duration + margin after the last renewal
    assert [s.live for s in service.lease_states()] == [False]
    with service.lock("gc"):
        assert blobs.has(MAINTENANCE_LOCK_KEY)
    held.__exit__(None, None, None)
    lease.release()
    assert renewal_threads() == []


def test_a_gc_whose_lock_renewals_fail_stops_deleting_before_it_could_lose_it_and_says_why() -> (
    None
):
    clock = FakeClock(1000.0)

    class LockWritesFail(MemoryBlobStore):
        down = False

        def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
            if self.down and key == MAINTENANCE_LOCK_KEY:
                raise BackendError("S3 PutObject locks/maintenance: connection reset")
            return super().put_conditional(key, data, expected)

    blobs = LockWritesFail(clock)
    settings = LeaseSettings(duration=120, margin=30)
    service = MaintenanceService(blobs, clock, LeaseManager(blobs, clock, settings))
    with service.lock("gc"):  # until 1120
        blobs.down = True
        clock.advance(60)
        with pytest.raises(BackendError, match="gc: renewing the maintenance lock: S3 PutObject"):
            service.refresh_lock()
        windows = service.sweep_windows()
        with windows.batch():  # a fresh window, until 1180
            windows.guard()
            clock.advance(31)  # 1091: another run could take the lock over at 1120
            with pytest.raises(LockHeld, match="renewing it failed: S3 PutObject"):
                windows.guard()


def test_a_killed_writers_fence_is_listed_nowhere_and_the_next_gc_removes_it(
    tmp_path: Path,
) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1), "w/kept")
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.liveness_workers", "declare", str(tmp_path), "w/new"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "declared\n"
    writer.kill()
    writer.wait()
    plan = repo.plan_gc(NO_GRACE)
    assert len(plan.expired_leases) == 1 and not plan.live_leases  # dead at once on its host
    plan.execute()
    fence = ref_key(RefName("w/new"))
    assert repo.blobs.has(fence)  # its commit is fenced...
    assert repo.ref_names() == ["w/kept"]  # ...but no listing shows a ref
    assert [r.name for r in repo.refs()] == ["w/kept"]
    listing = repo.list_refs()
    assert [r.name for r in listing.records] == ["w/kept"] and not listing.damaged
    assert repo.plan_gc(NO_GRACE).execute().removed_fences == 1  # its writer is dead
    assert not repo.blobs.has(fence) and not list(repo.blobs.list(FENCE_INDEX))
    repo.save(state(2), "w/new")
    assert repo.ref_names() == ["w/kept", "w/new"]


def test_a_writer_refused_for_a_lapsed_lease_takes_its_fence_away(tmp_path: Path) -> None:
    base = local_repo(tmp_path, leases={"duration": 1.2, "margin": 0.1})
    frozen = FrozenWriter(base.blobs)
    repo = cas.Repository(frozen, base.config)
    fence = ref_key(RefName("w/new"))
    with repo.leases.hold("slow commit"):
        tree, sources = encode_state(state(4))
        entries, _ = repo.write_tensors(sources)
        repo.leases.declare("w/new")
        frozen.freeze()  # the whole process stops, past its lease
        time.sleep(1.5)
        local_repo(tmp_path).plan_gc(NO_GRACE).execute()
        assert base.blobs.has(fence)
        frozen.thaw()
        with pytest.raises(LeaseExpired):
            repo.commit(Manifest("state", tuple(entries), tree, created_at=time.time()), "w/new")
    assert not base.blobs.has(fence)  # withdrawn when the lease was released
    assert repo.ref_names() == [] and repo.verify().ok
