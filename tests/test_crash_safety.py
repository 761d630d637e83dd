"""Invariant 1: a writer killed at any moment leaves every ref loadable and no partial object."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import cas
from cas.digest import Digest
from cas.objects.envelope import parse_envelope
from tests import crash_workers as workers
from tests.crash_writer import expected_state, write_forever


def _check_every_object_is_whole(store: Path) -> None:
    """No partial file sits under a final name: every chunk and manifest decodes to its digest."""
    repo = cas.open(store)
    try:
        for prefix in ("chunks/", "manifests/"):
            for key in repo.blobs.list(prefix):
                digest = Digest(key.rsplit("/", 1)[1])
                parse_envelope(repo.blobs.get(key), 1 << 30)
                if prefix == "chunks/":
                    repo.objects.get_chunk(digest)
                else:
                    repo.objects.get_manifest(digest)
    finally:
        repo.close()


def _check_refs(store: Path) -> int:
    repo = cas.open(store)
    try:
        report = repo.verify(level="existence")
        assert report.ok, report.problems
        latest = repo.refs_store.try_get("runs/crash/latest")
        if latest is None:
            return 0
        step = repo.manifest("runs/crash/latest").meta["step"]
        loaded = repo.load("runs/crash/latest")
        expected = expected_state(step)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (step, key)
        return int(step)
    finally:
        repo.close()


@pytest.mark.slow
def test_sigkill_at_random_moments_never_breaks_a_ref(tmp_path: Path) -> None:
    store = tmp_path / "store"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "cas", "tests.crash_writer"])
    rng = random.Random(20261121)
    kills = 0
    last_step = 0
    for _ in range(55):
        writer = context.Process(target=write_forever, args=(str(store), last_step + 1))
        writer.start()
        time.sleep(rng.uniform(0.05, 0.6))
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        assert writer.exitcode == -signal.SIGKILL
        kills += 1
        step = _check_refs(store)
        assert step >= last_step  # the ref never goes back to an older checkpoint
        last_step = step
    _check_every_object_is_whole(store)
    assert kills >= 50 and last_step > 5


KILLS_PER_OPERATION = 45
"""With the 55 kills of a saving writer above: 235 kill points across save, put, push, forget, gc."""


def _kill_repeatedly(
    target: Callable[..., None],
    args: tuple[str, ...],
    check: Callable[[], None],
    seed: int,
    delays: tuple[float, float] = (0.01, 0.2),
) -> int:
    """Start ``target(*args)``, SIGKILL it after a random delay and ``check`` the store,
    ``KILLS_PER_OPERATION`` times; return how many runs were killed (not finished) first."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["cas", "cas.cli", "tests.crash_workers"])
    rng = random.Random(seed)
    killed = 0
    for _ in range(KILLS_PER_OPERATION):
        worker = context.Process(target=target, args=args)
        worker.start()
        time.sleep(rng.uniform(*delays))
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        assert worker.exitcode in (-signal.SIGKILL, 0), worker.exitcode  # it never fails
        killed += worker.exitcode == -signal.SIGKILL
        check()
    return killed


def _check_loadable(store: Path) -> None:
    """Invariant 1: every ref's manifest and chunks are present, and no object is partial."""
    repo = workers.open_store(str(store))
    try:
        report = repo.verify(level="existence")
        assert report.ok, report.problems
    finally:
        repo.close()
    _check_every_object_is_whole(store)


def _after_killed_maintenance(store: Path) -> None:
    """A killed forget or gc left its lock: the operator's `cas unlock`, then the store must be
    consistent and the next GC must complete."""
    repo = workers.open_store(str(store))
    try:
        repo.break_maintenance_lock()
        _check_loadable(store)
        repo.plan_gc(workers.COLLECT_NOW).execute()
    finally:
        repo.close()
    _check_loadable(store)


@pytest.mark.slow
def test_sigkill_during_cas_put_of_files_and_directories_never_breaks_a_ref(
    tmp_path: Path,
) -> None:
    store, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    workers.open_store(str(store)).close()

    def check() -> None:
        _check_loadable(store)
        repo = workers.open_store(str(store))
        names = repo.ref_names("put/")
        if names:
            index = int(names[-1].rsplit("_", 1)[1])
            # One destination per ref: a file ref and a directory ref cannot share one.
            dest = tmp_path / "out" / names[-1].replace("/", "_")
            dest.parent.mkdir(exist_ok=True)
            out = repo.get_path(names[-1], dest, overwrite=True)
            restored = sorted(p.read_bytes() for p in out)
            expected = [workers.file_bytes(index)]
            if index % 2 == 0:
                expected = sorted([expected[0], workers.file_bytes(index + 1_000_000)])
            assert restored == expected, names[-1]
        repo.close()

    killed = _kill_repeatedly(workers.put_forever, (str(store), str(work)), check, seed=1)
    assert killed == KILLS_PER_OPERATION
    assert len(workers.open_store(str(store)).ref_names("put/")) > 5


@pytest.mark.slow
def test_sigkill_during_push_to_a_second_store_never_breaks_a_ref(tmp_path: Path) -> None:
    source, dest = tmp_path / "source", tmp_path / "dest"
    # Only the destination is under test: the source is written without fsync, to start fast.
    src = cas.open(source, config=workers.CONFIG, fsync=False)
    for index in range(50):
        src.put_path(_written(tmp_path / "f", workers.file_bytes(index)), f"src/ckpt_{index:06d}")
    workers.open_store(str(dest)).close()

    def check() -> None:
        _check_loadable(dest)
        dst = workers.open_store(str(dest))
        for name in dst.ref_names():
            assert dst.resolve(name) == src.resolve(name), name
        dst.close()

    work = str(tmp_path)
    killed = _kill_repeatedly(workers.push_forever, (str(source), str(dest), work), check, seed=2)
    assert killed == KILLS_PER_OPERATION  # the worker was still pushing when each kill came
    assert len(workers.open_store(str(dest)).ref_names()) > 5


@pytest.mark.slow
def test_sigkill_during_forget_leaves_a_store_whose_next_gc_completes(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = workers.open_store(str(store))
    repo.put_path(_written(tmp_path / "f", workers.file_bytes(0)), "base")

    def check() -> None:
        _after_killed_maintenance(store)
        assert workers.open_store(str(store)).find_ref("base") is not None

    killed = _kill_repeatedly(workers.forget_forever, (str(store),), check, seed=3)
    assert killed == KILLS_PER_OPERATION
    assert workers.next_index(repo, "fg/") > 5


@pytest.mark.slow
def test_sigkill_during_gc_leaves_a_store_whose_next_gc_completes(tmp_path: Path) -> None:
    store, work = tmp_path / "store", tmp_path / "work"
    work.mkdir()
    workers.open_store(str(store)).close()
    killed = _kill_repeatedly(
        workers.collect_forever,
        (str(store), str(work)),
        lambda: _after_killed_maintenance(store),
        seed=4,
    )
    assert killed == KILLS_PER_OPERATION
    assert workers.next_index(workers.open_store(str(store)), "gc/") > 5


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
