"""Sweep windows: GC announces each batch of deletions, so a commit can tell whether one overlapped it.

GC deletes only inside a window: it writes ``state/gc-sweep`` as ``sweeping`` before a batch and
as ``idle`` after the batch's last delete returned (docs/gc.md, "Safety"). A writer reads the
record when it takes its lease and again right before its ref compare-and-swap. An unchanged
``idle`` record means no deletion ran while it wrote; otherwise it waits for ``idle`` and checks
that every object its ref will name still exists (``settle``). The cost is two small reads per
commit, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from cas.blobstore.base import BlobStore, Version
from cas.errors import (
    CASError,
    FormatError,
    LeaseExpired,
    LockHeld,
    NotFound,
    PreconditionFailed,
)
from cas.model.bounded import load_record_json
from cas.refs.liveness import UNKNOWN, ProcessIdentity, current

SWEEP_KEY = "state/gc-sweep"
SWEEP_FORMAT = "cas-gc-sweep"
SWEEP_WINDOW = 300.0
"""How long one announced batch may take unless told (GC passes the store's lease duration), and
how long an unreadable record counts as a batch in progress."""
POLL = 0.05
"""How often a committing writer looks whether the batch in progress has ended."""


class HeldLock(Protocol):
    """The maintenance lock as a sweep sees it (``cas.refs.maintenance.MaintenanceLock``)."""

    @property
    def trouble(self) -> str:
        """Why the lock may be lost (a failed renewal, a takeover), or ``""``."""

    def safe_until(self) -> float:
        """Until when (storage time) no other run can have taken the lock over."""


class CollectedDuringWrite(LeaseExpired):
    """A GC sweep that overlapped the write deleted an object the commit would name; no ref
    moved. Writing again stores the object anew (``Repository.save`` does so by itself)."""


@dataclass(frozen=True)
class SweepState:
    """``state/gc-sweep`` as read: whether a batch of deletions is in progress, and until when."""

    version: Version | None
    """None: GC never swept this store."""
    sweeping: bool
    expires: float
    """In storage time, as everything GC writes."""
    who: ProcessIdentity = UNKNOWN

    def over(self, now: float, margin: float) -> bool:
        """Whether no deletion of this batch can still happen at ``now`` (storage time): idle,
        expired, or its GC process is certainly gone (``cas.refs.liveness``)."""
        return not self.sweeping or now >= self.expires + margin or self.who.gone()


IDLE = SweepState(None, False, 0.0)


def read_sweep(blobs: BlobStore) -> SweepState:
    """The current sweep record. An unreadable one counts as a batch in progress until its mtime
    plus a window, so a damaged record blocks commits no longer than a dead GC would."""
    try:
        data, version = blobs.get_versioned(SWEEP_KEY)
    except NotFound:
        return IDLE
    try:
        doc = load_record_json(data, "sweep record")
        return SweepState(
            version,
            doc["state"] == "sweeping",
            float(doc["expires"]),
            ProcessIdentity.from_doc(doc),
        )
    except (FormatError, ValueError, KeyError, TypeError):
        return SweepState(version, True, blobs.stat(SWEEP_KEY).mtime + SWEEP_WINDOW)


class SweepWindows:
    """GC's side: announce each batch of deletions, and refuse to delete once a window ran out."""

    def __init__(
        self,
        blobs: BlobStore,
        clock: Callable[[], float],
        holder: str,
        margin: float,
        lock: HeldLock | None = None,
        duration: float = SWEEP_WINDOW,
    ) -> None:
        self.blobs = blobs
        self.clock = clock
        self.holder = holder
        self.margin = margin
        self.lock = lock
        """The maintenance lock of the run: deleting stops ``margin`` before it could be lost."""
        self.duration = duration
        self.expires = 0.0
        self._version = read_sweep(blobs).version
        self.batches = 0

    def _write(self, state: str) -> None:
        now = self.clock()
        expires = now + self.duration
        doc = {
            "format": SWEEP_FORMAT,
            "version": 1,
            "state": state,
            "holder": self.holder,
            **current().fields(),
            "batch": self.batches,
            "at": now,
            "expires": expires,
            "token": uuid.uuid4().hex,  # every announcement changes the record's version
        }
        try:
            self._version = self.blobs.put_conditional(
                SWEEP_KEY, json.dumps(doc, sort_keys=True).encode(), self._version
            )
        except (PreconditionFailed, NotFound) as e:
            raise LockHeld(
                f"gc sweep: another run changed {SWEEP_KEY} (the maintenance lock was taken "
                "over); stopping before deleting more"
            ) from e
        self.expires = expires if state == "sweeping" else 0.0

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Announce a batch, run its deletions, announce the end (only if they all returned)."""
        self.batches += 1
        self._write("sweeping")
        yield
        self._write("idle")

    def guard(self) -> None:
        """Raise unless a delete may still run now: inside a window and while the maintenance
        lock is surely held, ``margin`` before either ends. Another run can take the lock over
        only after it expired, so two runs' batches never overlap."""
        now = self.clock()
        if now >= self.expires - self.margin:
            raise LockHeld(
                f"gc sweep: batch {self.batches} outlasted its window (expired at "
                f"{self.expires:.3f}, now {now:.3f}); stopping, nothing more deleted"
            )
        if self.lock is not None:
            until = self.lock.safe_until()
            if now >= until - self.margin:
                why = self.lock.trouble or "its renewals did not land in time"
                raise LockHeld(
                    f"gc sweep: batch {self.batches}: the maintenance lock may be lost (safe "
                    f"until {until:.3f}, now {now:.3f}: {why}); stopping, nothing more deleted"
                )


def settle(
    blobs: BlobStore,
    since: SweepState,
    clock: Callable[[], float],
    margin: float,
    missing: Callable[[], Iterable[str]],
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> SweepState:
    """A committing writer's check: LeaseExpired if a deletion that overlapped its write took an
    object its ref would name. ``since`` is the record read when the lease was taken;
    ``missing()`` names the needed objects that are gone. Returns the record it settled on.
    """
    current = read_sweep(blobs)
    if current.version == since.version and not since.sweeping:
        return current
    while not current.over(clock(), margin):
        sleep(POLL)
        current = read_sweep(blobs)
    try:
        gone = sorted(missing())
    except CASError as e:
        raise LeaseExpired(
            f"commit aborted: what it names cannot be read after a GC sweep: {e}"
        ) from e
    if gone:
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        raise CollectedDuringWrite(
            f"commit aborted: GC collected {len(gone)} object(s) this write relied on while it "
            f"ran ({shown}); no ref moved, write again to store them anew"
        )
    return current
