"""Background renewal: a daemon thread that keeps a lease or lock alive while its holder lives.

A writer that waits on a slow disk, a slow link or a long computation between two chunks makes no
progress, yet it is alive and its lease must hold; a long GC must never lose its lock. Each holder
gets one daemon thread that renews it every ``period`` seconds. The thread holds the holder only
weakly, so a holder dropped without being released stops its renewal (its blob then expires), and
``Renewal.stop`` ends it at once and waits for a renewal in flight, so nothing is renewed after a
release. A renewal that reports the lease lost ends the thread: a lapsed lease stays lapsed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

THREAD_PREFIX = "cas-renewal"
"""Every renewal thread's name starts with this (tests look for leaked ones by it)."""


class Renewal:
    """A running renewal thread; ``stop`` ends it."""

    def __init__(self, stop: threading.Event, thread: threading.Thread) -> None:
        self._stop = stop
        self.thread = thread

    def stop(self) -> None:
        """End the renewals and wait for one in flight (unless called from the thread itself)."""
        self._stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join()


def start_renewal(owner: T, renew: Callable[[T], bool], period: float, name: str) -> Renewal:
    """Call ``renew(owner)`` every ``period`` seconds on a daemon thread until it returns False,
    ``stop`` is called or ``owner`` is garbage collected. ``renew`` must not be a bound method of
    ``owner`` (the thread would keep it alive)."""
    stop = threading.Event()
    ref = weakref.ref(owner)

    def run() -> None:
        while not stop.wait(period):
            target = ref()
            if target is None or not renew(target):
                return
            del target

    thread = threading.Thread(target=run, name=f"{THREAD_PREFIX}-{name}", daemon=True)
    weakref.finalize(owner, stop.set)
    thread.start()
    return Renewal(stop, thread)
