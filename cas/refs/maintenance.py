"""The maintenance service: writer leases as GC sees them, the maintenance lock, the store's clock.

``cas forget`` and ``cas gc`` run under the store-wide maintenance lock (``locks/maintenance``):
a create-only blob with an expiry, so two maintenance runs never interleave and a crashed one
stops blocking once its lock expires (or an operator breaks it with ``cas unlock``). They read
the writer leases (``cas.refs.leases``) to learn what is in flight, reap the leases of writers
that died, and take "now" from the store's own clock, because object mtimes come from it.
``MaintenanceService`` gathers these for one store, with the clock injected, and keeps the small
documents one maintenance run leaves for the next (``state/``), so the retention layer and the
CLI never touch the blobs that hold them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cas.blobstore.base import BlobStore, Version
from cas.errors import BackendError, CASError, LockHeld, NotFound, PreconditionFailed
from cas.refs.leases import (
    LeaseManager,
    LeaseRecord,
    LeaseSettings,
    encode_json,
    read_leases,
    writer_id,
)
from cas.refs.liveness import process_gone
from cas.refs.sweeps import SWEEP_KEY, SweepWindows

MAINTENANCE_LOCK_KEY = "locks/maintenance"
LOCK_FORMAT = "cas-lock"
LOCK_DURATION = 600.0
"""How long a maintenance lock lasts unless refreshed (GC refreshes it every sweep batch); a dead
holder blocks no longer, and one on the same host not at all."""
STATE_PREFIX = "state/"
"""Where small documents of maintenance runs live (the clock probe, the verify sampler)."""
CLOCK_PROBE_KEY = STATE_PREFIX + "gc-clock"
"""The blob written to read the store's clock (its mtime)."""
_STATE_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


@dataclass(frozen=True)
class LockHolder:
    """Who holds the maintenance lock, as its blob says."""

    operation: str
    holder: str
    expires: float
    host: str = ""
    pid: int = 0

    def gone(self) -> bool:
        """Whether the holder is known dead: it ran on this host and its process is gone."""
        return process_gone(self.host, self.pid)

    @property
    def description(self) -> str:
        """``"gc by host-123-abcd"``."""
        return f"{self.operation} by {self.holder}"


@dataclass(frozen=True)
class LeaseStatus:
    """A writer lease and whether GC must still honour it."""

    lease: LeaseRecord
    live: bool


def parse_lock(data: bytes) -> LockHolder | None:
    """The holder a lock blob names, or None when it is unreadable."""
    try:
        doc = json.loads(data)
        return LockHolder(
            str(doc.get("operation", "?")),
            str(doc["holder"]),
            float(doc["expires"]),
            str(doc.get("host", "")),
            int(doc.get("pid", 0)),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class MaintenanceLock:
    """The store-wide lock of ``cas forget`` and ``cas gc``: a create-only blob with an expiry.

    A lock whose holder died is taken over once it expired (by compare-and-swap, so two
    contenders never both win). Long runs call ``refresh`` between phases.
    """

    def __init__(
        self,
        blobs: BlobStore,
        clock: Callable[[], float] = time.time,
        *,
        operation: str = "maintenance",
        duration: float = LOCK_DURATION,
    ) -> None:
        self.blobs = blobs
        self.clock = clock
        self.operation = operation
        self.duration = duration
        self.holder = writer_id()
        self._version: Version | None = None

    def _document(self) -> bytes:
        now = self.clock()
        return encode_json(
            {
                "format": LOCK_FORMAT,
                "version": 1,
                "holder": self.holder,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "operation": self.operation,
                "acquired": now,
                "expires": now + self.duration,
            }
        )

    def acquire(self) -> MaintenanceLock:
        """Take the lock or raise LockHeld naming who holds it and until when."""
        try:
            return self._take()
        except (LockHeld, PreconditionFailed):
            raise
        except CASError:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Remove the lock a write that reported failure stored all the same (an fsync failed
        after the rename, a reply was lost), so a failed start leaves nothing that blocks."""
        with contextlib.suppress(CASError):
            data, version = self.blobs.get_versioned(MAINTENANCE_LOCK_KEY)
            holder = parse_lock(data)
            if holder is not None and holder.holder == self.holder:
                self.blobs.delete_conditional(MAINTENANCE_LOCK_KEY, version)

    def _take(self) -> MaintenanceLock:
        try:
            self._version = self.blobs.put_conditional(MAINTENANCE_LOCK_KEY, self._document(), None)
            return self
        except PreconditionFailed:
            pass
        try:
            data, version = self.blobs.get_versioned(MAINTENANCE_LOCK_KEY)
        except NotFound:
            data, version = b"", None
        holder = parse_lock(data)
        if (
            version is not None
            and holder is not None
            and self.clock() < holder.expires
            and not holder.gone()
        ):
            raise LockHeld(
                f"{holder.description} holds the store's maintenance lock until "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(holder.expires))} UTC; "
                "try again later (or `cas unlock` if that process is gone)"
            )
        try:
            self._version = self.blobs.put_conditional(
                MAINTENANCE_LOCK_KEY, self._document(), version
            )
        except PreconditionFailed as e:
            raise LockHeld("another maintenance run took the store's lock just now") from e
        return self

    def refresh(self) -> None:
        """Extend the lock; LockHeld if someone took it over (it had expired)."""
        try:
            self._version = self.blobs.put_conditional(
                MAINTENANCE_LOCK_KEY, self._document(), self._version
            )
        except (PreconditionFailed, NotFound) as e:
            raise LockHeld("the maintenance lock expired and was taken over; stopping") from e

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self._version is None:
            return
        version, self._version = self._version, None
        try:
            # If it was taken over after expiring, it is someone else's now: leave it.
            with contextlib.suppress(PreconditionFailed, NotFound):
                self.blobs.delete_conditional(MAINTENANCE_LOCK_KEY, version)
        except CASError as e:
            raise BackendError(
                f"the store's maintenance lock could not be released ({e}); it blocks the next "
                "gc or forget until it expires, or until `cas unlock` removes it"
            ) from e

    def __enter__(self) -> MaintenanceLock:
        return self.acquire()

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if error is None:
            self.release()
            return
        # The run failed: its error names what failed; a failing release (the store that broke
        # the run is still down) must not replace it. An unreleased lock expires.
        with contextlib.suppress(CASError):
            self.release()


class MaintenanceService:
    """Writer leases, the maintenance lock and the store's clock, for one store.

    ``clock`` is the host's clock (injected so tests make time pass); ``store_time`` reads the
    storage's. ``writers`` are the leases this process's writers hold; their settings say how
    long a lease lasts and how much clock skew both sides allow.
    """

    def __init__(self, blobs: BlobStore, clock: Callable[[], float], writers: LeaseManager) -> None:
        self.blobs = blobs
        self.clock = clock
        self.writers = writers
        self._held: MaintenanceLock | None = None

    @property
    def settings(self) -> LeaseSettings:
        """The store's lease settings."""
        return self.writers.settings

    def leases(self) -> list[LeaseRecord]:
        """Every writer lease in the store; an unreadable one counts as started at its mtime."""
        return read_leases(self.blobs, self.settings.duration)

    def is_live(self, lease: LeaseRecord, now: float) -> bool:
        """Whether GC must still honour ``lease`` at ``now`` (until ``margin`` after expiry)."""
        return lease.live(now, self.settings.margin)

    def lease_states(self, now: float | None = None) -> list[LeaseStatus]:
        """Every lease with its liveness at ``now`` (default: this host's clock)."""
        when = self.clock() if now is None else now
        return [LeaseStatus(lease, self.is_live(lease, when)) for lease in self.leases()]

    def reap(self, lease: LeaseRecord) -> bool:
        """Delete an expired writer's lease unless it changed since it was read (its writer came
        back and refreshed it); whether it was deleted."""
        if lease.version is None:
            return False
        try:
            self.blobs.delete_conditional(lease.key, lease.version)
        except (PreconditionFailed, NotFound):
            return False
        return True

    @contextmanager
    def lock(
        self, operation: str, *, enabled: bool = True, duration: float = LOCK_DURATION
    ) -> Iterator[MaintenanceLock | None]:
        """Hold the maintenance lock for the block (``enabled=False``: the caller holds it)."""
        if not enabled:
            yield None
            return
        with MaintenanceLock(
            self.blobs, self.clock, operation=operation, duration=duration
        ) as held:
            outer, self._held = self._held, held
            try:
                yield held
            finally:
                self._held = outer

    def refresh_lock(self) -> None:
        """Extend the maintenance lock this service holds (no-op when the caller holds it)."""
        if self._held is not None:
            self._held.refresh()

    def sweep_windows(self) -> SweepWindows:
        """GC's announcements of its batches of deletions (``cas.refs.sweeps``)."""
        holder = self._held.holder if self._held is not None else writer_id()
        return SweepWindows(self.blobs, self.clock, holder, self.settings.margin)

    def lock_holder(self) -> LockHolder | None:
        """Who holds the maintenance lock (None when it is free or unreadable)."""
        try:
            return parse_lock(self.blobs.get(MAINTENANCE_LOCK_KEY))
        except NotFound:
            return None

    def break_lock(self) -> bool:
        """Remove the maintenance lock whoever holds it; True if there was one.

        For an operator whose ``cas forget``/``cas gc`` died: a live run that loses its lock
        stops at its next ``refresh``.
        """
        existed = self.blobs.has(MAINTENANCE_LOCK_KEY)
        self.blobs.delete(MAINTENANCE_LOCK_KEY)
        # The dead run's sweep window too, so no commit waits for it to expire.
        self.blobs.delete(SWEEP_KEY)
        return existed

    def read_state(self, name: str) -> bytes | None:
        """The maintenance document ``name`` (``verify-sample.json``), or None if absent."""
        try:
            return self.blobs.get(_state_key(name))
        except NotFound:
            return None

    def write_state(self, name: str, data: bytes) -> None:
        """Replace the maintenance document ``name``: state a run leaves for the next one."""
        self.blobs.put(_state_key(name), data)

    def store_time(self) -> float:
        """The current time on the storage's own clock: the mtime of a blob written just now.

        Object mtimes come from that clock (the kernel's coarse clock for local files, the
        server's for S3), so a cutoff taken from it is exactly comparable: anything a writer
        touches after this probe has an mtime at or after it, whatever the host clocks say.
        Falls back to the injected clock where the store cannot be written.
        """
        try:
            self.blobs.put(CLOCK_PROBE_KEY, b"gc")
            return self.blobs.stat(CLOCK_PROBE_KEY).mtime
        except CASError:
            return self.clock()


def _state_key(name: str) -> str:
    if not _STATE_NAME_RE.fullmatch(name):
        raise ValueError(f"bad maintenance state name {name!r}")
    return STATE_PREFIX + name
