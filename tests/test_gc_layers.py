"""GC's safety layers, each alone: one test per layer, built so that it is the only thing between a
race and a lost chunk (the other layers switched off by settings, an injected clock, or a race
that slips past them), so each test fails if its layer is taken away.

The layers (docs/gc.md, "Safety", "Writer leases", "The maintenance lock"):

- the grace period: an unreachable object younger than ``grace`` stays (writers without leases);
- writer leases: a live lease lowers the cutoff to its start, so what its writer wrote stays;
- reuse freshening: a writer that reuses a stored chunk refreshes its mtime, and the sweep's
  last-moment ``stat`` spares a chunk reused after planning;
- the sweep's re-check after its rename (local stores): a reuse between the ``stat`` and the
  rename is seen on the renamed file, which goes back;
- sweep windows: a commit that a batch of deletions overlapped checks that what it names is still
  there, so a reuse in the gap between GC's ``stat`` and its delete aborts the commit;
- the window's expiry: GC deletes nothing once its window ran out (writers stop waiting for it);
- fences: GC fences the refs an expired lease declared, so a writer paused between its lease
  check and its ref write cannot publish;
- the writer's own lease checks: before it stores its manifest, when it declares a ref, and
  right before it writes or deletes one;
- the maintenance lock: one GC at a time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cas import Repository
from cas.blobstore import MemoryBlobStore
from cas.blobstore.base import BlobInfo, BlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.digest import Digest, digest_of
from cas.errors import LeaseExpired, LockHeld
from cas.model.manifest import Manifest
from cas.model.state import encode_state
from cas.objects.keys import ObjectKind, object_key
from cas.objects.sweep import Window
from cas.refs.leases import LEASES_PREFIX, LeaseManager, LeaseSettings
from cas.refs.store import RefChange, RefStore
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from tests.retention_helpers import CHUNK, FakeClock, chunks_of, local_repo, state

NO_GRACE = GCSettings(grace=0, reflog_window=0)
LONG_LEASES = {"duration": 7200, "margin": 60}
NO_LEASES = {"enabled": False}
T0 = 1_000_000.0


def repo_over(blobs: BlobStore, clock: FakeClock, **extra: Any) -> Repository:
    """A repository on ``blobs`` (small chunks), its clock injected."""
    return Repository(blobs, StoreConfig(chunk_size=CHUNK, inline_max=64, extra=extra), clock=clock)


def missing_chunks(repo: Repository, ref: str) -> set[str]:
    """The chunks the checkpoint ``ref`` names that are not stored: a lost save when not empty."""
    names = repo.manifest(ref).chunk_digests()
    return {d for d in names if not repo.blobs.has(object_key(ObjectKind.CHUNK, Digest(d)))}


def unreachable_old_chunks(repo: Repository, clock: FakeClock, *seeds: int) -> None:
    """Store ``state(*seeds)``, drop its ref, and let an hour pass: its chunks are GC's to take."""
    repo.save(state(*seeds), "runs/old/ckpt")
    repo.rm("runs/old/ckpt")
    clock.advance(3600)


# -- the grace period ----------------------------------------------------------------------------


def test_grace_alone_keeps_the_fresh_chunks_of_a_writer_that_takes_no_lease() -> None:
    clock = FakeClock(T0)
    repo = repo_over(MemoryBlobStore(clock), clock, leases=NO_LEASES)
    _, sources = encode_state(state(1))
    repo.write_tensors(sources)  # another tool's writes: no lease, no ref yet
    clock.advance(60)
    assert repo.plan_gc(GCSettings(grace=600, reflog_window=0)).chunks == ()
    clock.advance(600)
    assert set(repo.plan_gc(GCSettings(grace=600, reflog_window=0)).chunks) == chunks_of(1)


# -- writer leases -------------------------------------------------------------------------------


def test_a_live_lease_alone_keeps_what_its_writer_wrote_long_ago() -> None:
    clock = FakeClock(T0)
    repo = repo_over(MemoryBlobStore(clock), clock, leases=LONG_LEASES)
    with repo.lease("slow writer"):
        tree, sources = encode_state(state(1))
        entries, _ = repo.write_tensors(sources)
        clock.advance(3600)  # far past grace 0, the lease still live
        repo.plan_gc(NO_GRACE).execute()
        repo.commit(Manifest("state", tuple(entries), tree, created_at=clock()), "runs/r/ckpt")
    assert missing_chunks(repo, "runs/r/ckpt") == set()


# -- reuse freshening ----------------------------------------------------------------------------


def test_reuse_freshening_alone_spares_a_chunk_reused_after_planning() -> None:
    clock = FakeClock(T0)
    repo = repo_over(MemoryBlobStore(clock), clock, leases=NO_LEASES)
    unreachable_old_chunks(repo, clock, 1)
    plan = repo.plan_gc(NO_GRACE)
    assert set(plan.chunks) == chunks_of(1)
    clock.advance(1)
    repo.save(state(1), "runs/new/ckpt")  # reuses every chunk the plan lists
    result = plan.execute()
    assert result.deleted_chunks == 0 and result.spared == 2
    assert missing_chunks(repo, "runs/new/ckpt") == set()


# -- the sweep's re-check after its rename (local) -----------------------------------------------


def test_the_sweeps_recheck_after_its_rename_alone_spares_a_chunk_reused_at_the_last_moment(
    tmp_path: Path,
) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1), "runs/r/ckpt")
    victim = sorted(chunks_of(1))[0]
    home = tmp_path / object_key(ObjectKind.CHUNK, victim)
    past = time.time() - 7200
    os.utime(home, (past, past))
    cutoff = time.time() - 3600  # the plan's: the chunk is older

    def reused_now() -> None:  # between the sweep's first stat and its rename
        repo.save(state(1), "runs/r/ckpt")  # touches the chunk: a reported save reuses it

    sweeper = repo.objects.sweeper()
    [outcome] = sweeper.remove_many([(ObjectKind.CHUNK, victim)], cutoff, Window(guard=reused_now))
    assert outcome.status == "spared"
    assert home.exists() and missing_chunks(repo, "runs/r/ckpt") == set()


# -- sweep windows -------------------------------------------------------------------------------


class _StallDelete(BlobStoreWrapper):
    """Runs ``hook`` once, right before the first delete of a chunk: after GC's last-moment
    ``stat`` of it, so a writer that reuses the chunk then is not seen by that check."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.hook: Callable[[], None] | None = None

    def delete(self, key: str) -> None:
        hook, self.hook = (self.hook, None) if key.startswith("chunks/") else (None, self.hook)
        if hook is not None:
            hook()
        self.inner.delete(key)


class _Writer(threading.Thread):
    """A writer on its own thread (a lease belongs to a thread): takes its lease, writes
    ``state(seed)`` when told, commits when told; ``error`` is what its commit raised."""

    def __init__(self, repo: Repository, seed: int, ref: str) -> None:
        super().__init__(daemon=True)
        self.repo, self.seed, self.ref = repo, seed, ref
        self.leased, self.write, self.written = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )
        self.commit, self.done = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.repo.lease("writer"):
                self.leased.set()
                assert self.write.wait(30)
                tree, sources = encode_state(state(self.seed))
                entries, _ = self.repo.write_tensors(sources)
                self.written.set()
                assert self.commit.wait(30)
                manifest = Manifest("state", tuple(entries), tree, created_at=self.repo.clock())
                self.repo.commit(manifest, self.ref)
        except BaseException as e:
            self.error = e
        finally:
            self.written.set()
            self.done.set()


def test_sweep_windows_alone_abort_a_commit_whose_chunk_went_between_gcs_check_and_delete() -> None:
    clock = FakeClock(T0)
    blobs = _StallDelete(MemoryBlobStore(clock))
    repo = repo_over(blobs, clock, leases=LONG_LEASES)
    unreachable_old_chunks(repo, clock, 1)
    writer = _Writer(repo, 1, "runs/new/ckpt")
    writer.start()
    assert writer.leased.wait(30)
    plan = repo.plan_gc(NO_GRACE)  # the lease is younger than the chunks: they are candidates
    assert set(plan.chunks) == chunks_of(1)

    def reuse_in_the_gap() -> None:
        clock.advance(1)
        writer.write.set()
        assert writer.written.wait(30)

    blobs.hook = reuse_in_the_gap
    result = plan.execute()
    assert result.deleted_chunks >= 1  # the race happened: a chunk the writer reused went
    writer.commit.set()
    assert writer.done.wait(30)
    assert isinstance(writer.error, LeaseExpired), "a commit naming a deleted chunk went through"
    assert repo.refs_store.try_get("runs/new/ckpt") is None


# -- fences ----------------------------------------------------------------------------------------


class _PauseBeforeRefWrite(BlobStoreWrapper):
    """Runs ``hook`` once, right before the first ref write: the writer has checked its lease and
    is about to send its compare-and-swap when it stalls (a GC pause, a suspended VM)."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.hook: Callable[[], None] | None = None

    def put_conditional(self, key: str, data: Any, expected: Any) -> Any:
        hook, self.hook = (self.hook, None) if key.startswith("refs/") else (None, self.hook)
        if hook is not None:
            hook()
        return self.inner.put_conditional(key, data, expected)


@pytest.mark.parametrize("existing", [False, True], ids=["new-ref", "existing-ref"])
def test_a_fence_alone_stops_a_writer_paused_between_its_lease_check_and_its_ref_write(
    existing: bool,
) -> None:
    clock = FakeClock(T0)
    store = MemoryBlobStore(clock)
    writer_blobs = _PauseBeforeRefWrite(store)
    writer = repo_over(writer_blobs, clock, leases={"duration": 600, "margin": 60})
    gc = repo_over(store, clock, leases={"duration": 600, "margin": 60})
    if existing:
        writer.save(state(9), "runs/r/ckpt")

    def gc_while_paused() -> None:
        clock.advance(600 + 61)  # the writer's lease ran out on GC's clock
        plan = gc.plan_gc(NO_GRACE)
        assert plan.expired_leases and chunks_of(1) <= set(plan.chunks)
        plan.execute()

    writer_blobs.hook = gc_while_paused
    with pytest.raises(LeaseExpired):
        writer.save(state(1), "runs/r/ckpt")
    record = gc.refs_store.try_get("runs/r/ckpt")
    assert record is None or missing_chunks(gc, "runs/r/ckpt") == set()


# -- the writer's own lease checks ---------------------------------------------------------------


def _lease_store(clock: FakeClock) -> tuple[MemoryBlobStore, LeaseManager, RefStore]:
    blobs = MemoryBlobStore(clock)
    leases = LeaseManager(blobs, clock, LeaseSettings(duration=600, margin=60))
    return blobs, leases, RefStore(blobs, clock, leases)


def _target(label: str) -> Digest:
    return digest_of(label.encode())


def test_the_lease_check_before_the_ref_write_alone_stops_a_lease_that_lapsed_after_declaring() -> (
    None
):
    clock = FakeClock(T0)
    _, leases, refs = _lease_store(clock)
    refs.set("runs/r/latest", _target("a"))

    def decide_slowly(current: object) -> Digest:  # declared and read; the lease lapses now
        clock.advance(600)
        return _target("b")

    with leases.hold("slow writer"), pytest.raises(LeaseExpired):
        refs.update("runs/r/latest", decide_slowly, op="late")
    assert refs.get("runs/r/latest").target == _target("a")


def test_the_lease_check_before_a_ref_delete_alone_stops_a_lease_that_lapsed_after_declaring() -> (
    None
):
    clock = FakeClock(T0)
    _, leases, refs = _lease_store(clock)
    refs.set("runs/r/latest", _target("a"))

    def delete_slowly(current: object) -> RefChange:
        clock.advance(600)
        return RefChange.DELETE

    with leases.hold("slow writer"), pytest.raises(LeaseExpired):
        refs.update("runs/r/latest", delete_slowly, op="rm")
    assert refs.get("runs/r/latest").target == _target("a")


def test_the_lease_check_when_declaring_alone_keeps_a_reaped_lease_gone() -> None:
    clock = FakeClock(T0)
    blobs, leases, refs = _lease_store(clock)
    with leases.hold("slow writer") as lease:
        assert lease is not None
        clock.advance(600 + 61)
        blobs.delete(LEASES_PREFIX + lease.writer_id)  # GC found it expired and reaped it
        with pytest.raises(LeaseExpired):
            refs.update("runs/r/latest", lambda current: _target("b"), op="late")
        assert not blobs.has(LEASES_PREFIX + lease.writer_id), (
            "a lapsed writer declared its ref: its lease came back after GC reaped it"
        )
    assert refs.try_get("runs/r/latest") is None


def test_the_lease_check_before_the_manifest_alone_keeps_a_lapsed_writers_manifest_out() -> None:
    clock = FakeClock(T0)
    repo = repo_over(MemoryBlobStore(clock), clock, leases={"duration": 600, "margin": 60})
    with repo.lease("slow writer"):
        tree, sources = encode_state(state(1))
        entries, _ = repo.write_tensors(sources)
        clock.advance(600 + 61)
        repo.plan_gc(NO_GRACE).execute()  # the lease expired: its chunks are collected
        manifest = Manifest("state", tuple(entries), tree, created_at=clock())
        with pytest.raises(LeaseExpired):
            repo.commit(manifest, "runs/r/late")
    # A manifest naming collected chunks would pass for a recent write and keep nothing whole.
    assert list(repo.blobs.list("manifests/")) == []


# -- the window's expiry and the maintenance lock ------------------------------------------------


class _StallStat(BlobStoreWrapper):
    """Runs ``hook`` once, right after GC's last-moment ``stat`` of a chunk."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.hook: Callable[[], None] | None = None

    def stat(self, key: str) -> BlobInfo:
        info = self.inner.stat(key)
        hook, self.hook = (self.hook, None) if key.startswith("chunks/") else (None, self.hook)
        if hook is not None:
            hook()
        return info


def test_a_gc_stalled_past_its_sweep_window_deletes_nothing_after_it() -> None:
    clock = FakeClock(T0)
    blobs = _StallStat(MemoryBlobStore(clock))
    repo = repo_over(blobs, clock, leases={"duration": 600, "margin": 60})
    unreachable_old_chunks(repo, clock, 1)
    plan = repo.plan_gc(NO_GRACE)
    assert set(plan.chunks) == chunks_of(1)
    saved: list[str] = []

    def stall_while_a_writer_saves() -> None:
        # GC freezes past its window: a writer no longer waits for it, and reuses the chunk
        # GC has just checked (its commit's existence check finds it there). Its lock was
        # renewed meanwhile (a renewal thread lives on while a sweep stalls): only the window
        # has run out.
        clock.advance(130)
        repo.maintenance.refresh_lock()
        clock.advance(600 + 61 - 130)
        writer = threading.Thread(target=lambda: saved.append(repo.save(state(1), "runs/new/c")))
        writer.start()
        writer.join(30)

    blobs.hook = stall_while_a_writer_saves
    with pytest.raises(LockHeld, match="outlasted its window"):
        plan.execute()
    assert saved, "the writer did not save"
    assert missing_chunks(repo, "runs/new/c") == set()


def test_the_maintenance_lock_keeps_a_second_gc_out_while_one_sweeps() -> None:
    clock = FakeClock(T0)
    blobs = _StallDelete(MemoryBlobStore(clock))
    repo = repo_over(blobs, clock)
    unreachable_old_chunks(repo, clock, 1)
    refused: list[BaseException] = []

    def second_gc() -> None:
        try:
            repo_over(blobs.inner, clock).plan_gc(NO_GRACE)
        except LockHeld as e:
            refused.append(e)

    blobs.hook = second_gc
    repo.plan_gc(NO_GRACE).execute()
    assert refused, "a second GC planned while the first one was sweeping"
    assert "holds the store's maintenance lock" in str(refused[0])
    assert repo.plan_gc(NO_GRACE).chunks == ()  # the first GC finished its sweep
