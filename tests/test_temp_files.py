"""A killed writer's temp files go with the next operation, and a live writer's never do.

The story of issue 26: 24 temp files were left after 10 SIGKILLs mid-save, and GC kept them for
an hour. Each writing handle now keeps its temp files in its own directory under an ``flock``
(``cas.blobstore.tempfiles``): once the lock can be taken, the writer is certainly gone, and the
next writer to open the store, or GC, removes its files whatever their age.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import cas
from cas.blobstore.local import TMP_DIR, LocalBlobStore
from cas.blobstore.tempfiles import dead_files, remove_dead
from tests.crash_writer import write_forever


def temp_files(store: Path) -> list[Path]:
    """Every temp file a writer left in the store (``gc-trash`` and key locks are not)."""
    return sorted((store / TMP_DIR).rglob("*.tmp"))


def _write_temp_then_die(root: str) -> None:
    """A writer killed between writing a temp file and renaming it."""
    LocalBlobStore(root)._write_temp(b"half a chunk")
    os.kill(os.getpid(), signal.SIGKILL)


def killed_writer(root: Path) -> None:
    """Run ``_write_temp_then_die`` in a child process and wait for its death."""
    context = multiprocessing.get_context("forkserver")
    child = context.Process(target=_write_temp_then_die, args=(str(root),))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL


def test_temp_files_of_writers_killed_10_times_mid_save_are_gone_after_the_next_save(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "cas", "tests.crash_writer"])
    rng = random.Random(26)
    step = 0
    for _ in range(10):
        writer = context.Process(target=write_forever, args=(str(store), step + 1))
        writer.start()
        time.sleep(rng.uniform(0.3, 1.0))
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        step += 1000
    killed_writer(store)  # one certain leftover, whatever moments the kills above hit
    left = temp_files(store)
    assert left
    with cas.open(store) as repo:
        repo.save({"x": 1}, "runs/next")
        assert temp_files(store) == []
    assert not any((store / TMP_DIR / "writers").iterdir())
    print(f"{len(left)} temp files left by 11 killed writers, 0 after the next save")


def test_gc_plans_and_removes_a_killed_writers_temp_files_whatever_their_age(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    cas.open(store).close()
    killed_writer(store)
    assert len(temp_files(store)) == 1
    with cas.open(store) as repo:
        sweeper = repo.objects.sweeper()
        names = [name for name, _ in sweeper.stale_tmp(cutoff=0.0)]
        assert len(names) == 1 and names[0].startswith("writers/")
        assert sweeper.remove_tmp(names, cutoff=0.0) == (1, len(b"half a chunk"))
    assert temp_files(store) == []
    killed_writer(store)
    gc = subprocess.run(
        [sys.executable, "-m", "cas", "--store", str(store), "gc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gc.returncode == 0 and temp_files(store) == [], gc


def test_a_live_writers_temp_files_are_never_taken_for_a_dead_ones(tmp_path: Path) -> None:
    writer = LocalBlobStore(tmp_path / "store")
    in_flight = writer._write_temp(b"being written")
    other = LocalBlobStore(tmp_path / "store")
    other.put("chunks/ab/cd", b"another writer's blob")  # its first write sweeps the dead
    assert in_flight.exists()
    assert dead_files(tmp_path / "store" / TMP_DIR) == []
    assert remove_dead(tmp_path / "store" / TMP_DIR) == (0, 0)
    os.replace(in_flight, tmp_path / "store" / "refs-published")
    writer.close()
    other.close()
    assert not any((tmp_path / "store" / TMP_DIR / "writers").iterdir())
