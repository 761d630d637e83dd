"""GC racing real writers: threads, processes, a paused writer, and GC killed at random points."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import cas
from cas.errors import LeaseExpired
from cas.model.manifest import Manifest
from cas.model.state import encode_state
from cas.objects.sweep import TRASH_DIR
from cas.retention.gc import GCResult, GCSettings
from tests.gc_workers import CHUNK, state, writer_loop
from tests.helpers import assert_bit_exact
from tests.retention_helpers import (
    FrozenWriter,
    chunk_digests,
    local_repo,
    reachable_chunks,
    tensor,
)

NO_GRACE = GCSettings(grace=0, reflog_window=0)
LEASES = {"duration": 30.0, "margin": 0.5}
"""Writers measure their offset to the storage's clock to within half the margin: 0.25 s holds on a
loaded machine, where a local write can take tens of milliseconds."""
ROOT = Path(__file__).resolve().parent.parent


def _gc_while(alive: Callable[[], bool], store: Path) -> list[GCResult]:
    repo = cas.open(store, create=False, fsync=False)
    results = []
    while alive():
        results.append(repo.plan_gc(NO_GRACE).execute())
    results.append(repo.plan_gc(NO_GRACE).execute())
    return results


def _check_survivors(store: Path, saves: list[tuple[str, list[int]]]) -> None:
    repo = cas.open(store, create=False)
    expected = dict((ref, seeds) for ref, seeds in saves)
    names = {r.name for r in repo.refs()}
    assert names and names <= expected.keys()
    for name in names:
        assert_bit_exact(repo.load(name), state(*expected[name]))
    assert repo.verify(level="full").ok
    assert chunk_digests(repo) == reachable_chunks(repo)


def test_writer_threads_saving_while_gc_runs_lose_no_chunk(tmp_path: Path) -> None:
    local_repo(tmp_path, leases=LEASES)
    outcomes: list[dict[str, Any]] = []

    def run(writer: int) -> None:
        outcomes.append(writer_loop(str(tmp_path), writer, 2.5))

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    results = _gc_while(lambda: any(t.is_alive() for t in threads), tmp_path)
    for t in threads:
        t.join()
    assert [p for o in outcomes for p in o["problems"]] == []
    saves = [tuple(s) for o in outcomes for s in o["saved"]]
    assert len(saves) > 30 and len(results) > 5
    assert sum(r.deleted_chunks for r in results) > 30  # GC really collected while they wrote
    _check_survivors(tmp_path, [(ref, list(seeds)) for ref, seeds in saves])


def test_writer_processes_saving_while_gc_runs_lose_no_chunk(tmp_path: Path) -> None:
    store = tmp_path / "store"
    local_repo(store, leases=LEASES)
    outs = [tmp_path / f"w{w}.json" for w in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.gc_workers", str(store), str(w), "3", str(outs[w])],
            cwd=ROOT,
        )
        for w in range(2)
    ]
    results = _gc_while(lambda: any(p.poll() is None for p in procs), store)
    assert [p.wait() for p in procs] == [0, 0]
    outcomes = [json.loads(out.read_text()) for out in outs]
    assert [p for o in outcomes for p in o["problems"]] == []
    saves = [s for o in outcomes for s in o["saved"]]
    assert len(saves) > 20 and sum(r.deleted_chunks for r in results) > 20
    _check_survivors(store, saves)


def test_writer_paused_past_its_lease_cannot_commit(tmp_path: Path) -> None:
    base = local_repo(tmp_path, leases={"duration": 0.6, "margin": 0.05})
    base.save(state(1), "w/ckpt_0")
    # The whole process stops (every thread, the lease's renewal thread too), not one thread:
    # a live writer's lease is renewed however long one of its threads waits.
    frozen = FrozenWriter(base.blobs)
    repo = cas.Repository(frozen, base.config)
    paused, resume = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def stall_once(_: int) -> None:
        if not paused.is_set():
            frozen.freeze()
            paused.set()
            resume.wait(10)

    def writer() -> None:
        try:
            repo.save(state(2, 3), "w/ckpt_1", progress=stall_once)
        except LeaseExpired as e:
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    assert paused.wait(10)
    time.sleep(0.8)  # the writer is stuck past its lease and margin
    result = local_repo(tmp_path).plan_gc(NO_GRACE).execute()
    assert result.reaped_leases == 1 and result.deleted_chunks == 4  # what it had stored
    frozen.thaw()
    resume.set()
    thread.join()
    assert len(errors) == 1 and "commit aborted" in str(errors[0])
    assert repo.refs_store.try_get("w/ckpt_1") is None
    assert repo.verify(level="full").ok
    assert_bit_exact(repo.load("w/ckpt_0"), state(1))

    # Paused between its last chunk and the ref update: the commit is refused as well.
    with repo.leases.hold("slow commit"):
        tree, sources = encode_state(state(4))
        entries, _ = repo.write_tensors(sources)
        frozen.freeze()
        time.sleep(0.8)
        assert local_repo(tmp_path).plan_gc(NO_GRACE).execute().deleted_chunks == 2
        frozen.thaw()
        try:
            repo.commit(Manifest("state", tuple(entries), tree, created_at=time.time()), "w/ckpt_2")
        except LeaseExpired:
            pass
        else:
            raise AssertionError("a writer whose lease expired committed")
    assert repo.refs_store.try_get("w/ckpt_2") is None and repo.verify().ok


def test_a_cas_url_write_paused_past_its_lease_before_its_commit_cannot_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cas.fs.writes as writes
    from cas.fs.filesystem import CASFileSystem

    base = local_repo(tmp_path, leases={"duration": 0.6, "margin": 0.05})
    frozen = FrozenWriter(base.blobs)
    repo = cas.Repository(frozen, base.config)
    fs = CASFileSystem(repo=repo, skip_instance_cache=True)
    publish = writes.put_record

    def paused_then_publish(*args: Any, **kwargs: Any) -> None:
        # The whole writer stops after its last lease check, before the ref compare-and-swap,
        # for longer than its lease: GC takes what only that lease protected.
        frozen.freeze()
        time.sleep(0.8)
        assert local_repo(tmp_path).plan_gc(NO_GRACE).execute().reaped_leases == 1
        frozen.thaw()
        publish(*args, **kwargs)

    monkeypatch.setattr(writes, "put_record", paused_then_publish)
    with pytest.raises(LeaseExpired), fs.open("runs/dcp/__0_0.distcp", "wb") as f:
        f.write(random.Random(5).randbytes(20_000))
    assert repo.refs_store.try_get("runs/dcp") is None  # nothing names the deleted chunks
    assert repo.verify(level="full").ok


def _gc_once(store: str) -> None:
    repo = cas.open(store, create=False, fsync=False)
    repo.plan_gc(NO_GRACE).execute()
    os._exit(0)


def test_gc_killed_at_random_points_leaves_every_kept_ref_loadable(tmp_path: Path) -> None:
    repo = local_repo(tmp_path)
    kept: dict[str, list[int]] = {}
    for i in range(10):
        kept[f"keep/ckpt_{i}"] = [i, i + 1]
        repo.save(state(i, i + 1), f"keep/ckpt_{i}")
    repo.cp("keep/ckpt_3", "gates/best")
    kept["gates/best"] = [3, 4]
    rng = random.Random(5)
    fork = multiprocessing.get_context("fork")
    killed = 0
    for iteration in range(20):
        for j in range(3):
            garbage = {"g": tensor(10_000 + 10 * iteration + j, 150 * CHUNK), "k": state(j)["t0"]}
            repo.save(garbage, f"scratch/g{j}")
            repo.rm(f"scratch/g{j}")
        repo.io.close()  # no worker threads across fork
        child = fork.Process(target=_gc_once, args=(str(tmp_path),))
        child.start()
        time.sleep(rng.uniform(0.0, 0.06))
        assert child.pid is not None  # set by start()
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        killed += child.exitcode == -signal.SIGKILL
        repo.break_maintenance_lock()  # what an operator's `cas unlock` does after a crash
        fresh = cas.open(tmp_path, create=False)
        for name, seeds in kept.items():
            assert_bit_exact(fresh.load(name), state(*seeds))
        assert fresh.verify(level="full").ok
        fresh.close()
    assert killed >= 10
    repo.plan_gc(NO_GRACE).execute()
    assert chunk_digests(repo) == reachable_chunks(repo)
    assert not list((tmp_path / TRASH_DIR).iterdir())
