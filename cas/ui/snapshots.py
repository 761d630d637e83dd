"""Whole-store answers kept for a while: what makes the storage and retention pages fast.

Accounting for every ref of a large store (``cas du``, ``cas status``, a retention plan) reads
every ref record and lists every object: seconds on a store of 10,000 checkpoints. ``cas ui``
computes each such answer once in the background when it starts, serves the last one computed,
and recomputes it in the background when it is older than ``max_age`` (stale while it
revalidates), so a page answers at once and is never more than one refresh behind. Every page
built from a snapshot shows its age. A request that comes before the first computation has
finished waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_AGE = 30.0
"""Seconds a snapshot is served before a request starts its recomputation."""


@dataclass(frozen=True)
class Snapshot:
    """One computed answer and when (wall clock) it was computed."""

    value: Any
    computed_at: float


class Snapshots:
    """Named answers, each computed by its function, at most one computation of each at once."""

    def __init__(self, max_age: float = MAX_AGE, clock: Callable[[], float] = time.time) -> None:
        self.max_age = max_age
        self.clock = clock
        self._lock = threading.Lock()
        self._done: dict[str, Snapshot] = {}
        self._running: dict[str, threading.Event] = {}
        self._errors: dict[str, BaseException] = {}

    def get(self, name: str, compute: Callable[[], Any], max_age: float | None = None) -> Snapshot:
        """The last answer for ``name``; computed now when there is none yet (or the last try
        failed), refreshed in the background when older than ``max_age`` (default: the
        store-wide one)."""
        limit = self.max_age if max_age is None else max_age
        with self._lock:
            done = self._done.get(name)
            running = self._running.get(name)
            stale = done is not None and self.clock() - done.computed_at > limit
        if done is None:
            if running is None:
                self._compute(name, compute)
            else:
                running.wait()
            with self._lock:
                if name in self._done:
                    return self._done[name]
                raise self._errors.pop(name)
        if stale and running is None:
            self.refresh(name, compute)
        return done

    def refresh(self, name: str, compute: Callable[[], Any]) -> None:
        """Recompute ``name`` on a daemon thread (unless that is already under way)."""
        with self._lock:
            if name in self._running:
                return
            self._running[name] = threading.Event()
        threading.Thread(
            target=self._compute, args=(name, compute, True), name=f"cas-ui-{name}", daemon=True
        ).start()

    def _compute(self, name: str, compute: Callable[[], Any], claimed: bool = False) -> None:
        with self._lock:
            if not claimed:
                if name in self._running:
                    event = self._running[name]
                    self._lock.release()
                    try:
                        event.wait()
                    finally:
                        self._lock.acquire()
                    return
                self._running[name] = threading.Event()
            event = self._running[name]
        try:
            value = compute()
            with self._lock:
                self._done[name] = Snapshot(value, self.clock())
                self._errors.pop(name, None)
        except BaseException as e:  # kept for the waiting request to raise: a page says it
            with self._lock:
                self._errors[name] = e
        finally:
            with self._lock:
                del self._running[name]
            event.set()
