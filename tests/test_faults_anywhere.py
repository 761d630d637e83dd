"""Faults anywhere in push, pull, gc and forget: a full disk (ENOSPC on a small tmpfs) or a failing
one (EIO at each call in turn, from a faulty store above the backend's edge and from a failing
disk below it) ends in one line, publishes nothing half done, and leaves a store that the next
run finishes once the fault is gone."""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas
from cas.blobstore.local import LocalBlobStore
from cas.repo.config import StoreConfig
from cas.retention.gc import GCSettings
from cas.retention.policy import RetentionPolicy, Rule
from cas.testing.faulty import FaultyBlobStore
from tests.failing_disk import FailingDisk
from tests.test_write_integrity import (
    array,
    assert_no_partial_objects,
    assert_refused_in_one_line,
    cas_cli,
    eio,
    fill,
)

CONFIG = StoreConfig(chunk_size=64 << 10, inline_max=256)
NO_GRACE = GCSettings(grace=0, reflog_window=0)
LAYERS = ["store", "disk"]
"""Where the fault strikes: ``store`` a FaultyBlobStore's calls, ``disk`` the file system's."""


class Fault:
    """One fault at the n-th call under one store's directory, in the ``store`` or ``disk`` layer.

    ``repo()`` opens the store through the fault; ``armed()`` is the block the fault may strike
    in. Afterwards ``struck`` names the call it struck (None if the operation made fewer calls).
    """

    def __init__(self, root: Path, layer: str, point: int | None) -> None:
        self.root = root
        self.layer = layer
        self.point = point
        self.faulty = FaultyBlobStore(LocalBlobStore(root), error=eio)
        self.disk = FailingDisk(root)
        if point is not None:
            (self.faulty if layer == "store" else self.disk).fail_call(point)

    def repo(self) -> cas.Repository:
        if self.layer == "store":
            return cas.Repository(self.faulty, CONFIG)
        with self.armed():
            return cas.open(self.root, config=CONFIG)

    def armed(self) -> AbstractContextManager[Any]:
        return self.disk.installed() if self.layer == "disk" else nullcontext()

    @property
    def calls(self) -> int:
        return sum((self.faulty.calls if self.layer == "store" else self.disk.calls).values())

    @property
    def struck(self) -> str | None:
        if self.layer == "store":
            return next(iter(self.faulty.faults), None)
        return self.disk.struck[0] if self.disk.struck else None


def strike_each_call(
    layer: str, fresh_store: Callable[[int | None], Path], operation: Callable[[Fault], None]
) -> Iterator[tuple[Fault, Exception | None]]:
    """Run ``operation`` once without a fault to count its calls, then once per call with that
    call failing, each time on a fresh store; yield each fault and what the operation raised."""
    counted = Fault(fresh_store(None), layer, None)
    operation(counted)
    calls = counted.calls
    assert calls > 5
    for point in range(calls):
        fault = Fault(fresh_store(point), layer, point)
        try:
            operation(fault)
        except cas.CASError as e:
            # One line, and it names the real cause, however deep the fault struck.
            assert len(str(e).splitlines()) == 1 and "Input/output error" in str(e), str(e)
            yield fault, e
        else:
            yield fault, None


def assert_nothing_half_published(root: Path, fault: Fault | None = None) -> None:
    """Every ref names a manifest whose chunks are all there and verify, every object under a
    final name is whole, and no temp file is left (unless the disk failed to delete it: then it
    stays in ``tmp/``, where no reader looks and GC removes it)."""
    report = cas.open(root).verify(level="full")
    assert report.ok, report.problems
    if fault is not None and fault.struck == "unlink":
        for leftover in (root / "tmp").rglob("*.tmp"):
            leftover.unlink()
    assert_no_partial_objects(root)


# -- push and pull -------------------------------------------------------------------------------


def source_store(root: Path) -> cas.Repository:
    """Two checkpoints, one sharing chunks with the other, a few chunks each."""
    repo = cas.open(root, config=CONFIG)
    base = np.arange(40_000, dtype=np.float32)
    repo.save({"w": base, "b": np.ones(9_000, dtype=np.int64)}, "runs/r1/step1")
    repo.save({"w": base, "b": np.full(9_000, 2, dtype=np.int64)}, "runs/r1/step2")
    return repo


@pytest.mark.parametrize("faulty_side", ["destination", "source"])
@pytest.mark.parametrize("layer", LAYERS)
def test_an_io_error_at_any_point_of_a_push_publishes_no_ref_naming_missing_objects(
    tmp_path: Path, layer: str, faulty_side: str
) -> None:
    source_root = tmp_path / "source"
    source = source_store(source_root)
    older, newer = source.resolve("runs/r1/step1"), source.resolve("runs/r1/step2")

    def destination_root(point: int | None) -> Path:
        return tmp_path / f"destination-{point}"

    def fresh_store(point: int | None) -> Path:
        destination = cas.open(destination_root(point), config=CONFIG)
        # The destination names an older checkpoint already: a fault leaves it or the new one.
        source.push(destination, ["runs/r1/step1"])
        destination.set_ref("runs/r1/step2", older)
        return destination_root(point) if faulty_side == "destination" else source_root

    def push(fault: Fault) -> None:
        faulty = fault.repo()
        with fault.armed():
            if faulty_side == "destination":
                source.push(faulty, ["runs/"])
            else:
                faulty.push(cas.open(destination_root(fault.point)), ["runs/"])

    failures = 0
    for fault, error in strike_each_call(layer, fresh_store, push):
        failures += error is not None
        root = destination_root(fault.point)
        assert_nothing_half_published(root, fault)
        destination = cas.open(root)
        assert destination.resolve("runs/r1/step2") in (older, newer)
        source.push(destination, ["runs/"])  # the next push completes
        assert_nothing_half_published(root)
        assert np.array_equal(array(destination, "runs/r1/step2", "b"), np.full(9_000, 2))
    assert cas.open(source_root).verify(level="full").ok
    assert failures > 5


@pytest.mark.parametrize("command", ["push", "pull"])
def test_a_transfer_onto_a_full_disk_fails_in_one_line_and_publishes_no_ref(
    small_disk: Path, tmp_path: Path, command: str
) -> None:
    source = tmp_path / "source"
    data = random.Random(9).randbytes(4 << 20)
    (tmp_path / "weights.bin").write_bytes(data)
    assert cas_cli(source, "put", str(tmp_path / "weights.bin"), "r/x").returncode == 0
    destination = small_disk / "store"
    assert cas_cli(destination, "init").returncode == 0
    ballast = fill(small_disk, leave=1 << 20)

    def transfer() -> Any:
        if command == "push":
            return cas_cli(source, "push", "r/x", "--to", str(destination))
        return cas_cli(destination, "pull", "r/x", "--from", str(source))

    assert_refused_in_one_line(transfer(), "No space left on device")
    assert cas_cli(destination, "ls").stdout.strip() == ""
    assert_no_partial_objects(destination)
    ballast.unlink()
    assert transfer().returncode == 0
    assert cas_cli(destination, "get", "r/x", str(tmp_path / "back.bin")).returncode == 0
    assert (tmp_path / "back.bin").read_bytes() == data
    assert cas_cli(destination, "verify", "--full").returncode == 0


# -- gc and forget -------------------------------------------------------------------------------


def store_with_garbage(root: Path) -> set[str]:
    """A store with one kept checkpoint and one removed; the chunks the kept one needs."""
    repo = cas.open(root, config=CONFIG)
    repo.save({"w": np.arange(50_000, dtype=np.float32)}, "runs/kept")
    kept = set(repo.blobs.list("chunks/"))
    repo.save({"w": np.arange(60_000, dtype=np.float64)}, "runs/dropped")
    repo.rm("runs/dropped")
    time.sleep(0.02)  # every object is older than the cutoff of a gc without grace
    return kept


@contextmanager
def next_run_allowed(error: Exception | None) -> Iterator[None]:
    """The next maintenance run starts at once, unless the failed one could not release its lock,
    said so and how to proceed, and the operator did (``cas unlock``)."""
    try:
        yield
    except cas.errors.LockHeld:
        assert error is not None and "`cas unlock`" in str(error), error
        raise


def run_unlocked(root: Path, error: Exception | None, run: Callable[[cas.Repository], Any]) -> Any:
    """``run`` on the store once the fault is gone, breaking a lock the failed run said it left."""
    repo = cas.open(root)
    try:
        with next_run_allowed(error):
            return run(repo)
    except cas.errors.LockHeld:
        assert repo.break_maintenance_lock()
        return run(repo)


@pytest.mark.parametrize("layer", LAYERS)
def test_an_io_error_at_any_point_of_gc_leaves_a_store_the_next_gc_finishes(
    tmp_path: Path, layer: str
) -> None:
    template = tmp_path / "template"
    kept = store_with_garbage(template)

    def fresh_store(point: int | None) -> Path:
        return Path(shutil.copytree(template, tmp_path / f"gc-{point}"))

    def gc(fault: Fault) -> None:
        repo = fault.repo()
        with fault.armed():
            repo.plan_gc(NO_GRACE).execute()

    failures = 0
    for fault, error in strike_each_call(layer, fresh_store, gc):
        failures += error is not None
        assert_nothing_half_published(fault.root, fault)
        run_unlocked(fault.root, error, lambda r: r.plan_gc(NO_GRACE).execute())
        assert set(cas.open(fault.root).blobs.list("chunks/")) == kept
        assert_nothing_half_published(fault.root)
        assert not (fault.root / "locks" / "maintenance").exists()
    assert failures > 5


@pytest.mark.parametrize("layer", LAYERS)
def test_an_io_error_at_any_point_of_forget_removes_whole_refs_and_the_next_forget_finishes(
    tmp_path: Path, layer: str
) -> None:
    template = tmp_path / "template"
    repo = cas.open(template, config=CONFIG)
    for step in range(4):
        repo.save({"w": np.full(20_000, step, dtype=np.float32)}, f"runs/r1/ckpt_{step}")
    policy = RetentionPolicy(rules=(Rule("runs/r1/ckpt_*", keep_last=1, eviction_log="r1"),))
    repo.store_retention_policy(policy)

    def fresh_store(point: int | None) -> Path:
        return Path(shutil.copytree(template, tmp_path / f"forget-{point}"))

    def forget(fault: Fault) -> None:
        repo = fault.repo()
        with fault.armed():
            repo.forget(policy)

    failures = 0
    for fault, error in strike_each_call(layer, fresh_store, forget):
        failures += error is not None
        assert_nothing_half_published(fault.root, fault)
        assert "runs/r1/ckpt_3" in cas.open(fault.root).ref_names("runs/")
        run_unlocked(fault.root, error, lambda r: r.forget(policy))
        after = cas.open(fault.root)
        assert after.ref_names("runs/") == ["runs/r1/ckpt_3"]
        # Each removed ref was logged first (a fault between log and removal may log it twice).
        logged = {record["ref"] for record in after.eviction_log("r1")}
        assert logged == {f"runs/r1/ckpt_{step}" for step in range(3)}
        assert not (fault.root / "locks" / "maintenance").exists()
    assert failures > 5


def test_gc_on_a_full_disk_fails_in_one_line_and_frees_space_once_there_is_room(
    small_disk: Path, tmp_path: Path
) -> None:
    store = small_disk / "store"
    (tmp_path / "weights.bin").write_bytes(random.Random(10).randbytes(2 << 20))
    assert cas_cli(store, "put", str(tmp_path / "weights.bin"), "r/x").returncode == 0
    assert cas_cli(store, "rm", "r/x").returncode == 0
    ballast = fill(small_disk, leave=0)
    gc = cas_cli(store, "gc", "--grace", "0", "--reflog-window", "0")
    assert_refused_in_one_line(gc, "No space left on device")
    assert cas_cli(store, "leases").stdout.strip().endswith("maintenance lock: free")
    ballast.unlink()
    assert cas_cli(store, "gc", "--grace", "0", "--reflog-window", "0").returncode == 0
    assert list(LocalBlobStore(store).list("chunks/")) == []
