"""Worker threads kept between store handles, lent to one handle at a time.

A script that opens a store, saves and closes it (``cas.open(...).save(...)``, a cron job, the
CLI's verbs) used to start a store handle's twelve chunk workers anew each time, and the
directory fsyncs of every commit started sixteen more. Starting a thread waits for it to take
the GIL from workers already hashing: a 1 GiB re-save, a tenth of a second of hashing, spent
13-16 ms of it starting threads (``cProfile``: 22 starts a save). A closed handle now hands its
idle threads back here, and the next handle of the process takes them (``LentPool``).

Each handle still has its threads to itself while it is open, and its ``shutdown`` still waits
for every task it submitted, as ``ThreadPoolExecutor.shutdown(wait=True)`` did: ``LentPool``
counts its own tasks and waits for the count to fall to zero. Only threads whose handle's work
has all ended are kept, at most ``SPARE_POOLS`` sets per size and priority.

Priority and CPUs are part of a set's identity. Chunk workers run at the nice value, and on the
CPUs, of the thread that asked for the pool: a manager's background save asks from a thread it
lowered, and a remote tier's drain from one kept on ``CAS_DRAIN_CPUS``, and their workers must
not take the training loop's cores; a foreground save's workers must neither crawl nor be kept
off them. Each worker takes its set's nice and CPUs as it starts; a set whose workers could not
(lowering nice needs privileges) is not kept.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

SPARE_POOLS = 2
"""Idle sets of threads a process keeps for its next handles, per size, priority and CPUs: enough for
a handle open beside a short-lived one (a manager and a CLI call, a save and a push)."""


def thread_cpus() -> frozenset[int]:
    """The CPUs the calling thread may run on (Linux keeps a set per thread); empty where the
    platform does not say."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return frozenset(os.sched_getaffinity(0))


def thread_priority() -> int:
    """The calling thread's nice value (Linux keeps one per thread); 0 elsewhere."""
    if not sys.platform.startswith("linux"):
        return 0
    with contextlib.suppress(OSError):
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return 0


class _Threads:
    """An executor of ``workers`` threads, each at nice ``nice`` on ``cpus``; ``unset`` lists
    those that could not take them."""

    def __init__(self, workers: int, name: str, nice: int, cpus: frozenset[int]) -> None:
        self.nice = nice
        self.cpus = cpus
        self.unset: list[int] = []
        self.executor = ThreadPoolExecutor(
            workers, thread_name_prefix=name, initializer=self._start_worker
        )

    def _start_worker(self) -> None:
        """Each worker's first act: take the set's priority and CPUs (otherwise it inherits
        those of whichever thread happened to start it)."""
        try:
            if self.cpus and thread_cpus() != self.cpus:
                os.sched_setaffinity(0, self.cpus)
            if sys.platform.startswith("linux") and thread_priority() != self.nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError:
            self.unset.append(threading.get_native_id())


_spare: dict[tuple[int, int, frozenset[int]], list[_Threads]] = {}
_spare_lock = threading.Lock()


class LentPool(Executor):
    """A pool of ``workers`` threads lent to one store handle until its ``shutdown``."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self._key = (workers, thread_priority(), thread_cpus())
        with _spare_lock:
            spares = _spare.get(self._key)
            threads = spares.pop() if spares else None
        self._threads = threads or _Threads(workers, name, *self._key[1:])
        self._running = 0
        self._settled = threading.Condition()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on one of the lent threads."""
        with self._settled:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._running += 1
        try:
            future = self._threads.executor.submit(fn, *args, **kwargs)
        except BaseException:
            self._one_done()
            raise
        future.add_done_callback(lambda _: self._one_done())
        return future

    def _one_done(self) -> None:
        with self._settled:
            self._running -= 1
            if not self._running:
                self._settled.notify_all()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more tasks; with ``wait``, return once every task submitted here has ended,
        and hand the threads back for the next handle. ``cancel_futures`` cancels those not
        started, as ``ThreadPoolExecutor`` does."""
        with self._settled:
            if self._closed:
                return
            self._closed = True
        executor = self._threads.executor
        if not wait or cancel_futures:
            executor.shutdown(wait=wait, cancel_futures=cancel_futures)
            return
        with self._settled:
            self._settled.wait_for(lambda: self._running == 0)
        if not self._threads.unset:
            with _spare_lock:
                spares = _spare.setdefault(self._key, [])
                if len(spares) < SPARE_POOLS:
                    spares.append(self._threads)
                    return
        executor.shutdown(wait=True)


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads: its spares would take tasks no thread
    ever runs."""
    global _spare_lock
    _spare.clear()
    _spare_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
