"""A closed store handle gives its chunk workers back, and the next handle of the process takes
them, while each handle still has its threads to itself and its close waits for its own tasks."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import cas
from cas import threads
from cas.threads import LentPool


def _workers(pool: LentPool, count: int) -> set[threading.Thread]:
    """The threads that ran ``count`` tasks held open together (each task waits until all have
    started, so each runs on a thread of its own). Thread objects, not idents: the system hands
    a finished thread's ident to the next thread it starts."""
    barrier = threading.Barrier(count, timeout=10)

    def one() -> threading.Thread:
        barrier.wait()
        return threading.current_thread()

    return {f.result() for f in [pool.submit(one) for _ in range(count)]}


def test_a_second_handle_runs_on_the_threads_the_first_gave_back(tmp_path: Path) -> None:
    first = cas.open(tmp_path / "store")
    first.save({"w": np.arange(1 << 20, dtype=np.float32)}, "runs/a")
    idents = _workers(first.io.pool, first.io.workers)
    first.close()
    second = cas.open(tmp_path / "store")
    assert _workers(second.io.pool, second.io.workers) == idents
    assert second.load("runs/a")["w"][-1] == (1 << 20) - 1
    second.close()


def test_two_open_handles_never_share_threads(tmp_path: Path) -> None:
    one, two = cas.open(tmp_path / "a"), cas.open(tmp_path / "b")
    try:
        assert not _workers(one.io.pool, 4) & _workers(two.io.pool, 4)
    finally:
        one.close()
        two.close()


def test_shutdown_waits_for_every_task_the_handle_submitted() -> None:
    pool = LentPool(3, "test-lent")
    finished: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.2)
        finished.append(i)

    for i in range(6):
        pool.submit(slow, i)
    pool.shutdown(wait=True)
    assert sorted(finished) == list(range(6))
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(slow, 7)


def test_threads_still_busy_are_not_given_back() -> None:
    release = threading.Event()
    pool = LentPool(2, "test-busy")
    pool.submit(release.wait, 10)
    done = threading.Thread(target=pool.shutdown)
    done.start()
    time.sleep(0.2)
    assert done.is_alive()  # close waits for the task
    assert pool._threads not in threads._spare.get(
        (2, threads.thread_priority(), threads.thread_cpus()), []
    )
    release.set()
    done.join(10)
    assert not done.is_alive()


def test_no_more_than_the_spares_are_kept() -> None:
    pools = [LentPool(5, "test-spares") for _ in range(threads.SPARE_POOLS + 2)]
    for pool in pools:
        pool.submit(int)
    for pool in pools:
        pool.shutdown()
    key = (5, threads.thread_priority(), threads.thread_cpus())
    assert len(threads._spare[key]) == threads.SPARE_POOLS
    assert pools[-1]._threads.executor._shutdown  # the one past the bound was stopped
    for kept in threads._spare.pop(key):
        kept.executor.shutdown()


def _priorities(pool: LentPool, count: int) -> set[int]:
    barrier = threading.Barrier(count, timeout=10)

    def one() -> int:
        barrier.wait()
        return threads.thread_priority()

    return {f.result() for f in [pool.submit(one) for _ in range(count)]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice per thread is Linux's")
def test_workers_run_at_the_priority_of_the_thread_that_asked_and_are_kept_apart() -> None:
    own = threads.thread_priority()
    lowered: list[LentPool] = []

    def background() -> None:  # a manager's save thread, lowered by background_nice
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own + 5))
        lowered.append(LentPool(3, "test-nice"))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert _priorities(lowered[0], 3) == {min(19, own + 5)}  # started from this thread
    lowered[0].shutdown()
    foreground = LentPool(3, "test-nice")  # asked for at this thread's priority
    assert foreground._threads is not lowered[0]._threads
    assert _priorities(foreground, 3) == {own}
    foreground.shutdown()
    for key in [(3, own, threads.thread_cpus()), (3, min(19, own + 5), threads.thread_cpus())]:
        for kept in threads._spare.pop(key, []):
            kept.executor.shutdown()


def _cpus(pool: LentPool, count: int) -> set[frozenset[int]]:
    barrier = threading.Barrier(count, timeout=10)

    def one() -> frozenset[int]:
        barrier.wait()
        return threads.thread_cpus()

    return {f.result() for f in [pool.submit(one) for _ in range(count)]}


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to keep a thread on one",
)
def test_workers_run_on_the_cpus_of_the_thread_that_asked_and_are_kept_apart() -> None:
    everywhere = threads.thread_cpus()
    one_cpu = frozenset({max(everywhere)})
    pinned: list[LentPool] = []

    def drain() -> None:  # a remote tier's drain thread, kept on CAS_DRAIN_CPUS
        os.sched_setaffinity(0, one_cpu)
        pinned.append(LentPool(3, "test-cpus"))

    thread = threading.Thread(target=drain)
    thread.start()
    thread.join()
    assert _cpus(pinned[0], 3) == {one_cpu}  # started from this thread, which may use all
    pinned[0].shutdown()
    foreground = LentPool(3, "test-cpus")
    assert foreground._threads is not pinned[0]._threads
    assert _cpus(foreground, 3) == {everywhere}
    foreground.shutdown()
    own = threads.thread_priority()
    for key in [(3, own, everywhere), (3, own, one_cpu)]:
        for kept in threads._spare.pop(key, []):
            kept.executor.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_starts_threads_of_its_own(tmp_path: Path) -> None:
    parent = cas.open(tmp_path / "store")
    parent.save({"w": np.ones(1 << 20, dtype=np.float32)}, "runs/parent")
    parent.close()  # its threads are now spares, which do not come along to a child
    assert threads._spare
    pid = os.fork()
    if pid == 0:
        import signal

        signal.alarm(60)  # a child waiting on threads it does not have dies instead of hanging
        ok = not threads._spare
        child = cas.open(tmp_path / "store")
        child.save({"w": np.zeros(1 << 20, dtype=np.float32)}, "runs/child")
        ok = ok and child.load("runs/child")["w"].sum() == 0
        child.close()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
