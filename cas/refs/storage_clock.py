"""The storage's clock as this host sees it: the offset between the two, measured, not assumed.

Object mtimes come from the storage (the kernel's coarse clock for a local file system, the
server's for S3), and GC compares them, and the lease and lock times writers and other GCs
record, with its own reading of that clock. A writer whose clock is minutes off would otherwise
write a lease that GC reads as long expired. So every writer and GC works in storage time: it
writes a blob, reads the mtime the storage gave it, and takes the offset to lie between that
mtime less the host time after the write and the mtime plus the storage's mtime resolution less
the host time before it. The midpoint is the offset, half the width its uncertainty. The lease
``margin`` must cover what is left, so an uncertainty over ``margin / 2`` (a write that took
too long, a store that reports no mtimes) is refused with ``ClockSkew`` after a few tries
(DESIGN invariant 12, docs/gc.md "Clocks").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from cas.blobstore.base import BlobStore
from cas.errors import BackendError, CASError, ClockSkew

TRIES = 5
"""Measurements a sync makes (narrowing each time) before it refuses for a wide uncertainty."""


@dataclass(frozen=True)
class Offset:
    """Storage time minus host time, known to lie between ``low`` and ``high``."""

    low: float
    high: float

    @property
    def value(self) -> float:
        """The best estimate (the midpoint)."""
        return (self.low + self.high) / 2

    @property
    def uncertainty(self) -> float:
        """How far the true offset may be from ``value``."""
        return (self.high - self.low) / 2

    def narrowed(self, other: Offset) -> Offset:
        """What both measurements allow; the newer one alone when they disagree (the host's
        clock was stepped between them)."""
        low, high = max(self.low, other.low), min(self.high, other.high)
        return Offset(low, high) if low <= high else other


ZERO = Offset(0.0, 0.0)


class StorageClock:
    """This host's clock corrected by the last offset measured against one store's clock."""

    def __init__(self, clock: Callable[[], float], margin: float) -> None:
        self.host_clock = clock
        self.margin = margin
        self.offset: Offset | None = None
        """None until the first ``sync``: until then storage time is taken to be host time."""
        self._lock = threading.Lock()

    def now(self) -> float:
        """The storage's current time, as far as this host knows it."""
        offset = self.offset
        return self.host_clock() + (offset.value if offset is not None else 0.0)

    @property
    def limit(self) -> float:
        """The largest uncertainty the margin allows: half of it, as a writer's and a GC's
        errors may add up."""
        return self.margin / 2

    def sync(self, blobs: BlobStore, key: str, write: Callable[[], None]) -> float:
        """Measure the offset from ``write()``, which writes ``key`` on ``blobs``; returns the
        mtime of the last write. ClockSkew if it cannot be measured, or not to within
        ``limit`` in ``TRIES`` writes."""
        found: Offset | None = None
        mtime = 0.0
        resolution = max(0.0, blobs.mtime_resolution)
        for _ in range(TRIES):
            before = self.host_clock()
            write()
            after = self.host_clock()
            try:
                mtime = blobs.stat(key).mtime
            except BackendError:
                raise  # a failing storage, not a clock: the caller handles it as any I/O error
            except CASError as e:
                raise ClockSkew(
                    f"the storage's clock cannot be read (stat of {key} after writing it: {e}); "
                    "refusing to rely on this host's clock"
                ) from e
            if mtime <= 0:
                raise ClockSkew(
                    f"the storage's clock cannot be read: {blobs.url} reports no modification "
                    f"time for {key}; refusing to rely on this host's clock"
                )
            sample = Offset(mtime - after, mtime + resolution - before)
            found = sample if found is None else found.narrowed(sample)
            if found.uncertainty <= self.limit:
                with self._lock:
                    self.offset = found
                return mtime
        assert found is not None
        raise ClockSkew(
            f"this host's clock is {found.value:+.3f}s off the storage's, measured only to within "
            f"±{found.uncertainty:.3f}s in {TRIES} writes of {key}; the lease margin "
            f"({self.margin:g}s) allows ±{self.limit:g}s: raise `margin` in the store's "
            "'leases' config, or write from a host nearer the storage"
        )
