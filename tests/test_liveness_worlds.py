"""Liveness in an untidy world: writers and GCs in another PID namespace or with a skewed clock.

A process is taken for dead by its pid only on the same host, boot and PID namespace; every
lease, lock and sweep time is the storage's, measured from a blob just written (DESIGN invariant
12). The real-process tests run a writer under ``unshare --pid`` or libfaketime while GC runs with
grace 0 in this process; ``scripts/soak_liveness.py`` runs the same for minutes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cas
from cas.blobstore.base import BlobInfo, BlobStore, BytesLike, Version
from cas.blobstore.memory import MemoryBlobStore
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import ClockSkew, LockHeld
from cas.names import RefName
from cas.refs.leases import LEASES_PREFIX, read_leases
from cas.refs.liveness import ProcessIdentity, current
from cas.refs.records import FencedWriter, encode_fence, read_fence
from cas.refs.storage_clock import StorageClock
from cas.repo.config import StoreConfig
from cas.retention.gc import GCResult, GCSettings
from cas.testing import ManualClock
from cas.testing.worlds import (
    clock_offset_env,
    faketime_unavailable,
    in_pid_namespace,
    unshare_unavailable,
)
from tests.gc_workers import CHUNK, state
from tests.helpers import assert_bit_exact
from tests.prerequisites import require
from tests.retention_helpers import local_repo

NO_GRACE = GCSettings(grace=0, reflog_window=0)
ROOT = Path(__file__).resolve().parent.parent
WORKER = [sys.executable, "-m", "tests.liveness_workers"]
SAVER = [sys.executable, "-m", "tests.gc_workers"]
SKEW = 300.0
"""Five minutes: ten times the default lease margin."""


@pytest.fixture(scope="module")
def unshare() -> None:
    """A new PID namespace can be made here (as root), else skip (fail under CI)."""
    require(unshare_unavailable())


@pytest.fixture(scope="module")
def faketime() -> None:
    """libfaketime is installed, else skip (fail under CI)."""
    require(faketime_unavailable())


def _start(argv: list[str], ready: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if line != f"{ready}\n":
        child.kill()
        pytest.fail(f"worker said {line!r}, not {ready!r}")
    return child


def _finish(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    assert child.wait(timeout=60) == 0


def _pid_absent_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --- another PID namespace -------------------------------------------------------------------


def test_a_writer_and_a_gc_in_another_pid_namespace_keep_their_lease_and_lock(
    tmp_path: Path, unshare: None
) -> None:
    repo = local_repo(tmp_path)
    other = _start(in_pid_namespace([*WORKER, "hold-both", str(tmp_path)]), "held")
    try:
        [state_] = repo.writer_leases()
        lease, holder = state_.lease, repo.maintenance_lock_holder()
        assert holder is not None
        # Same host name, and no process with their pid here: only the namespace tells they live.
        assert lease.host == holder.host == socket.gethostname()
        assert _pid_absent_here(lease.pid) and _pid_absent_here(holder.pid)
        assert lease.who.pid_ns and lease.who.pid_ns != current().pid_ns
        assert state_.live
        with pytest.raises(LockHeld, match="gc by"):
            repo.plan_gc(NO_GRACE)
    finally:
        _finish(other)
    plan = repo.plan_gc(NO_GRACE)  # released: the next run proceeds
    assert not plan.live_leases


def _saves_while_gc_runs(
    store: str, command: Callable[[list[str]], list[str]], env: dict[str, str] | None, secs: float
) -> tuple[dict[str, Any], list[GCResult]]:
    """Run a saving writer (``tests.gc_workers``) through ``command`` while GC with grace 0 loops
    here; its outcome and GC's results."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"saves-{os.getpid()}-{time.monotonic_ns()}"
    writer = subprocess.Popen(command([*SAVER, store, "0", str(secs), str(out)]), cwd=ROOT, env=env)
    local: dict[str, Any] = {} if "://" in store else {"fsync": False}
    gc = cas.open(store, create=False, **local)
    results = []
    while writer.poll() is None:
        results.append(gc.plan_gc(NO_GRACE).execute())
    assert writer.wait() == 0
    results.append(gc.plan_gc(NO_GRACE).execute())
    outcome: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return outcome, results


def _behind(argv: list[str]) -> list[str]:
    return [*argv, str(-SKEW)]  # tests.gc_workers's clock offset


def _assert_no_save_lost(store: str, outcome: dict[str, Any], results: list[GCResult]) -> None:
    assert outcome["problems"] == []  # each save re-read in full before it was removed
    saved = {ref: seeds for ref, seeds in outcome["saved"]}
    assert len(saved) >= 3 and sum(r.deleted_chunks for r in results) > 0
    repo = cas.open(store, create=False)
    names = {r.name for r in repo.refs()}
    assert names and names <= saved.keys()
    for name in names:  # the newest two of every reported save are still there and load
        assert_bit_exact(repo.load(name), state(*saved[name]))


def _small_chunks(store: str, **extra: Any) -> None:
    cas.open(store, config=StoreConfig(chunk_size=CHUNK, inline_max=64, extra=extra)).close()


def test_a_writer_in_another_pid_namespace_loses_no_save_to_gc_with_grace_0(
    tmp_path: Path, unshare: None
) -> None:
    _small_chunks(str(tmp_path))
    outcome, results = _saves_while_gc_runs(str(tmp_path), in_pid_namespace, None, 2.5)
    _assert_no_save_lost(str(tmp_path), outcome, results)


# --- a writer whose clock is off (libfaketime) ------------------------------------------------


@pytest.mark.parametrize("offset", [-SKEW, SKEW])
def test_a_writer_whose_clock_is_off_writes_its_lease_in_storage_time(
    tmp_path: Path, faketime: None, offset: float
) -> None:
    repo = local_repo(tmp_path)
    writer = _start([*WORKER, "hold-lease", str(tmp_path)], "held", clock_offset_env(offset))
    try:
        plan = repo.plan_gc(NO_GRACE)
        [lease] = plan.live_leases
        assert abs(lease.started - plan.now) < 5  # not 300 s off: the storage's time
    finally:
        _finish(writer)


def test_a_writer_five_minutes_behind_loses_no_save_to_gc(tmp_path: Path) -> None:
    # The writer process runs its cas on a clock 300 s behind. (Not libfaketime here: it also
    # fakes the time ``utime(NULL)`` stamps on a local file, which no skewed host can do to a
    # local file system; S3 below stamps every time itself, so libfaketime is faithful there.)
    _small_chunks(str(tmp_path))
    outcome, results = _saves_while_gc_runs(str(tmp_path), _behind, None, 2.5)
    _assert_no_save_lost(str(tmp_path), outcome, results)


@pytest.mark.s3
def test_a_writer_five_minutes_behind_loses_no_save_to_gc_on_s3(
    s3_url: str, faketime: None
) -> None:
    _small_chunks(s3_url, leases={"duration": 30.0, "margin": 4.0})
    writer = _start([*WORKER, "hold-lease", s3_url], "held", clock_offset_env(-SKEW))
    try:
        plan = cas.open(s3_url, create=False).plan_gc(NO_GRACE)
        [lease] = plan.live_leases
        assert abs(lease.started - plan.now) < 5  # S3's Last-Modified time, not the writer's
    finally:
        _finish(writer)
    outcome, results = _saves_while_gc_runs(s3_url, list, clock_offset_env(-SKEW), 4.0)
    _assert_no_save_lost(s3_url, outcome, results)


# --- a GC whose clock is off ------------------------------------------------------------------


@pytest.mark.parametrize("offset", [-SKEW, SKEW])
def test_a_gc_whose_clock_is_off_honours_live_leases_and_the_maintenance_lock(
    tmp_path: Path, offset: float
) -> None:
    true_gc = local_repo(tmp_path)
    skewed_gc = local_repo(tmp_path, clock=lambda: time.time() + offset)
    with skewed_gc.maintenance.lock("gc"), pytest.raises(LockHeld):
        true_gc.plan_gc(NO_GRACE)
    with true_gc.maintenance.lock("gc"), pytest.raises(LockHeld):
        skewed_gc.plan_gc(NO_GRACE)
    writer = local_repo(tmp_path)
    with writer.lease("save"):
        lease_blob = writer.blobs.stat(next(iter(writer.blobs.list(LEASES_PREFIX))))
        plan = skewed_gc.plan_gc(NO_GRACE)
        assert len(plan.live_leases) == 1 and not plan.expired_leases
        assert abs(plan.now - lease_blob.mtime) < 5


def test_a_gc_whose_clock_is_behind_announces_its_sweep_in_storage_time(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    repo.save(state(1, 2), "w/a")
    repo.rm("w/a")
    skewed = local_repo(tmp_path, clock=lambda: time.time() - SKEW)
    seen: list[float] = []

    class Watch(BlobStoreWrapper):
        def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
            doc = json.loads(bytes(data)) if key == "state/gc-sweep" else {}
            if doc.get("state") == "sweeping":
                seen.append(doc["expires"] - time.time())
            return self.inner.put_conditional(key, data, expected)

    watched = cas.Repository(Watch(skewed.blobs), skewed.config, clock=skewed.clock)
    assert watched.plan_gc(NO_GRACE).execute().deleted_chunks > 0
    # A writer's commit waits for a sweep until it expires: 2 min ahead, not 3 min past.
    assert seen and all(100 < left < 130 for left in seen)


# --- the identity and offset logic ------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_process_is_judged_dead_by_pid_only_on_the_same_host_boot_and_namespace() -> None:
    me = current()
    if not (me.boot_id and me.pid_ns):
        pytest.skip("no /proc: no process is ever judged dead by its pid here")
    dead = dataclasses.replace(me, pid=_dead_pid(), pid_start=0)
    assert dead.gone()
    assert not dataclasses.replace(dead, host="other").gone()
    assert not dataclasses.replace(dead, boot_id="another-boot").gone()
    assert not dataclasses.replace(dead, pid_ns="4:1").gone()  # a container sharing the host name
    assert not ProcessIdentity(me.host, dead.pid).gone()  # an older record: never by its pid
    with subprocess.Popen(["sleep", "30"]) as alive:
        try:
            live = dataclasses.replace(me, pid=alive.pid, pid_start=0)
            assert not live.gone()
            assert dataclasses.replace(live, pid_start=1).gone()  # its pid was reused
        finally:
            alive.kill()
    assert not me.gone() and dataclasses.replace(me, pid_start=me.pid_start + 1).gone()


def test_an_older_lease_without_boot_and_namespace_is_honoured_until_it_expires() -> None:
    doc: dict[str, Any] = {"format": "cas-lease", "writer": "w", "host": socket.gethostname()}
    doc |= {"pid": _dead_pid(), "started": 1000.0, "expires": 1120.0}
    blobs = MemoryBlobStore()
    blobs.put(LEASES_PREFIX + "w", json.dumps(doc).encode())
    [lease] = read_leases(blobs)
    assert not lease.writer_gone()
    assert lease.live(1149.0, 30.0) and not lease.live(1150.0, 30.0)


def test_a_fence_record_keeps_what_tells_its_writers_dead() -> None:
    me = current()
    writers = (FencedWriter.of("w1", me), FencedWriter("w2", "old-host", 7))
    fence = read_fence(encode_fence(RefName("r/a"), "token", writers, 5.0), None)
    assert fence is not None and fence.writers == writers
    assert fence.writers[0].identity() == me


class _SlowWrites(BlobStoreWrapper):
    """Each write takes ``seconds`` of the host clock (a slow link)."""

    def __init__(self, inner: BlobStore, clock: ManualClock, seconds: float) -> None:
        super().__init__(inner)
        self.clock, self.seconds = clock, seconds

    def put_transient(self, key: str, data: BytesLike) -> None:
        self.inner.put_transient(key, data)
        self.clock.advance(self.seconds)


class _NoMtimes(BlobStoreWrapper):
    def stat(self, key: str) -> BlobInfo:
        return dataclasses.replace(self.inner.stat(key), mtime=0.0)


def test_the_offset_to_the_storage_clock_is_measured_from_the_blob_just_written() -> None:
    host = ManualClock()
    blobs = MemoryBlobStore(lambda: host() - SKEW)  # the storage runs 5 min behind this host
    repo = cas.Repository(blobs, StoreConfig(), clock=host)
    with repo.lease("save") as lease:
        assert lease is not None
        assert repo.leases.storage.offset is not None
        assert repo.leases.storage.offset.value == -SKEW
        assert lease.started == blobs.stat(lease.key).mtime == host() - SKEW


@pytest.mark.parametrize(
    ("wrap", "message"),
    [
        (lambda b, c: _SlowWrites(b, c, 40.0), r"±20\.000s .* margin \(30s\) allows ±15s"),
        (lambda b, c: _NoMtimes(b), "reports no modification time"),
    ],
)
def test_a_writer_that_cannot_measure_its_offset_closely_enough_refuses_in_one_line(
    wrap: Callable[[BlobStore, ManualClock], BlobStore], message: str
) -> None:
    host = ManualClock()
    blobs = wrap(MemoryBlobStore(host), host)
    repo = cas.Repository(blobs, StoreConfig(), clock=host)
    with pytest.raises(ClockSkew, match=message) as refused:
        repo.save(state(1), "w/a")
    assert "\n" not in str(refused.value)
    assert repo.ref_names() == [] and not list(blobs.list(LEASES_PREFIX))


def test_a_storage_clock_narrows_its_offset_over_several_writes() -> None:
    host = ManualClock(1000.25)
    storage = StorageClock(host, margin=1.2)
    blobs = MemoryBlobStore(lambda: float(int(host())))  # whole seconds, as S3 reports them

    class WholeSeconds(BlobStoreWrapper):
        @property
        def mtime_resolution(self) -> float:
            return 1.0

    def write() -> None:
        blobs.put("probe", b"x")
        host.advance(0.5)

    # One write leaves it within ±0.75 s, more than the margin allows; a second narrows it.
    storage.sync(WholeSeconds(blobs), "probe", write)
    assert host() == 1001.25
    assert storage.offset is not None and storage.offset.uncertainty <= 0.6
    assert storage.offset.low <= 0.0 <= storage.offset.high
