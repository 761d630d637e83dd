"""The maintenance service: writer leases as GC sees them, the maintenance lock, the store's clock.

``cas forget`` and ``cas gc`` run under the store-wide maintenance lock (``locks/maintenance``):
a create-only blob with an expiry, so two maintenance runs never interleave and a crashed one
stops blocking once its lock expires (or an operator breaks it with ``cas unlock``). They read
the writer leases (``cas.refs.leases``) to learn what is in flight, reap the leases of writers
that died, and take "now" from the store's own clock, because object mtimes come from it: the
lock, sweep windows and fences are written and judged in storage time too
(``cas.refs.storage_clock``), and a holder is judged dead by its pid only where that is certain
(``cas.refs.liveness``).
``MaintenanceService`` gathers these for one store, with the clock injected, and keeps the small
documents one maintenance run leaves for the next (``state/``), so the retention layer and the
CLI never touch the blobs that hold them.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cas.blobstore.base import BlobStore, Version
from cas.errors import (
    BackendError,
    CASError,
    ClockSkew,
    FormatError,
    LockHeld,
    NotFound,
    PreconditionFailed,
)
from cas.model.bounded import load_record_json
from cas.refs import fences
from cas.refs.fences import FenceEntry
from cas.refs.leases import (
    RENEWALS_PER_DURATION,
    LeaseManager,
    LeaseRecord,
    LeaseSettings,
    encode_json,
    read_leases,
    writer_id,
)
from cas.refs.liveness import UNKNOWN, ProcessIdentity, current
from cas.refs.renewal import Renewal, start_renewal
from cas.refs.sweeps import SWEEP_KEY, SweepWindows

MAINTENANCE_LOCK_KEY = "locks/maintenance"
LOCK_FORMAT = "cas-lock"
LOCK_DURATION = LeaseSettings.duration
"""How long a maintenance lock lasts unless renewed, by default (``MaintenanceService`` uses the
store's lease duration): a renewal thread renews it every quarter of that while its run lives, so
a dead holder blocks the next run no longer than this, and one certainly dead (same host, boot and
PID namespace: ``cas.refs.liveness``) not at all."""
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
    who: ProcessIdentity = UNKNOWN

    def gone(self) -> bool:
        """Whether the holder is certainly dead: same host, boot and PID namespace as this
        process, and its process is gone (``cas.refs.liveness``)."""
        return self.who.gone()

    @property
    def host(self) -> str:
        """The holder's host name."""
        return self.who.host

    @property
    def pid(self) -> int:
        """The holder's pid (in its own PID namespace)."""
        return self.who.pid

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
        doc = load_record_json(data, "maintenance lock")
        return LockHolder(
            str(doc.get("operation", "?")),
            str(doc["holder"]),
            float(doc["expires"]),
            ProcessIdentity.from_doc(doc),
        )
    except (FormatError, ValueError, KeyError, TypeError, AttributeError):
        return None


class MaintenanceLock:
    """The store-wide lock of ``cas forget`` and ``cas gc``: a create-only blob with an expiry.

    While held, a daemon thread renews it by compare-and-swap every quarter of its duration
    (``cas.refs.renewal``), so a long run keeps it and a killed one stops blocking once it
    expires. A lock whose holder died is taken over once it expired (by compare-and-swap, so two
    contenders never both win); the run that lost it learns so at its next renewal and stops
    deleting before the taker could start (``safe_until``).
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
        self.expires = 0.0
        """The expiry of the last write of the lock known to have landed."""
        self._version: Version | None = None
        self._lost = ""
        self._failed = ""
        self._renewal: Renewal | None = None
        self._mutex = threading.Lock()

    def _document(self, now: float) -> bytes:
        return encode_json(
            {
                "format": LOCK_FORMAT,
                "version": 1,
                "holder": self.holder,
                **current().fields(),
                "operation": self.operation,
                "acquired": now,
                "expires": now + self.duration,
            }
        )

    def acquire(self) -> MaintenanceLock:
        """Take the lock or raise LockHeld naming who holds it and until when; then keep it
        renewed until ``release``."""
        try:
            self._take()
        except (LockHeld, PreconditionFailed):
            raise
        except CASError:
            self._abandon()
            raise
        period = self.duration / RENEWALS_PER_DURATION
        self._renewal = start_renewal(self, MaintenanceLock._renew_in_background, period, "lock")
        return self

    def _abandon(self) -> None:
        """Remove the lock a write that reported failure stored all the same (an fsync failed
        after the rename, a reply was lost), so a failed start leaves nothing that blocks."""
        with contextlib.suppress(CASError):
            data, version = self.blobs.get_versioned(MAINTENANCE_LOCK_KEY)
            holder = parse_lock(data)
            if holder is not None and holder.holder == self.holder:
                self.blobs.delete_conditional(MAINTENANCE_LOCK_KEY, version)

    def _take(self) -> None:
        now = self.clock()
        sent = self._document(now)
        try:
            self._version = self.blobs.put_conditional(MAINTENANCE_LOCK_KEY, sent, None)
            self.expires = now + self.duration
            return
        except PreconditionFailed:
            pass
        try:
            data, version = self.blobs.get_versioned(MAINTENANCE_LOCK_KEY)
        except NotFound:
            data, version = b"", None
        if version is not None and data == sent:
            # Our own take, whose reply was lost and whose retry then found the key taken: the
            # document names this run and the instant it was written, so no one else wrote it.
            self._version = version
            self.expires = now + self.duration
            return
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
        now = self.clock()
        try:
            self._version = self.blobs.put_conditional(
                MAINTENANCE_LOCK_KEY, self._document(now), version
            )
        except PreconditionFailed as e:
            raise LockHeld("another maintenance run took the store's lock just now") from e
        self.expires = now + self.duration

    def refresh(self) -> None:
        """Extend the lock now; LockHeld if it was lost (taken over after it expired, or
        removed by ``cas unlock``)."""
        with self._mutex:
            if self._lost:
                raise LockHeld(f"{self.operation}: {self._lost}; stopping")
            if self._version is None:
                return  # released
            now = self.clock()
            try:
                self._version = self.blobs.put_conditional(
                    MAINTENANCE_LOCK_KEY, self._document(now), self._version
                )
            except (PreconditionFailed, NotFound) as e:
                self._lost = "the maintenance lock expired and was taken over, or was removed"
                raise LockHeld(f"{self.operation}: {self._lost}; stopping") from e
            except CASError as e:
                self._failed = f"renewing it failed: {e}"
                raise type(e)(f"{self.operation}: renewing the maintenance lock: {e}") from e
            self._failed = ""
            self.expires = now + self.duration

    @staticmethod
    def _renew_in_background(lock: MaintenanceLock) -> bool:
        """One renewal by the renewal thread; False ends the thread (the lock was lost). A
        failed write is retried at the next period: the run stops deleting if none lands."""
        try:
            lock.refresh()
        except LockHeld:
            return False
        except CASError:
            return True
        return True

    @property
    def trouble(self) -> str:
        """Why the lock may be lost (taken over, or its last renewal failed), or ``""``."""
        with self._mutex:
            return self._lost or self._failed

    def safe_until(self) -> float:
        """Until when (storage time) no other run can have taken the lock over."""
        with self._mutex:
            return -math.inf if self._lost else self.expires

    def release(self) -> None:
        """Stop renewing and remove the lock if it is still ours."""
        if self._renewal is not None:
            self._renewal.stop()
            self._renewal = None
        with self._mutex:
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
        self.storage = writers.storage
        """The storage's clock as this host knows it (shared with the writers)."""
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
        """Every lease with its liveness at ``now`` (default: the storage's clock)."""
        when = self.store_time() if now is None else now
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
        self, operation: str, *, enabled: bool = True, duration: float | None = None
    ) -> Iterator[MaintenanceLock | None]:
        """Hold the maintenance lock for the block (``enabled=False``: the caller holds it); it
        lasts ``duration`` unless renewed, by default the store's lease duration."""
        if not enabled:
            yield None
            return
        lasts = self.settings.duration if duration is None else duration
        self.store_time()  # the lock's expiry is written in storage time: measure the offset
        clock = self.storage.now
        with MaintenanceLock(self.blobs, clock, operation=operation, duration=lasts) as held:
            outer, self._held = self._held, held
            try:
                yield held
            finally:
                self._held = outer

    def refresh_lock(self) -> None:
        """Extend the maintenance lock this service holds now, besides its renewal thread
        (no-op when the caller holds it); LockHeld if it was lost."""
        if self._held is not None:
            self._held.refresh()

    def sweep_windows(self) -> SweepWindows:
        """GC's announcements of its batches of deletions (``cas.refs.sweeps``); a batch stops
        deleting ``margin`` before the lock could be taken over. A window lasts as long as a
        lease, so a GC that died mid-batch holds up commits no longer than a dead writer would."""
        held = self._held
        holder = held.holder if held is not None else writer_id()
        margin, duration = self.settings.margin, self.settings.duration
        return SweepWindows(self.blobs, self.storage.now, holder, margin, held, duration)

    def stale_fences(self, now: float) -> list[FenceEntry]:
        """The fence records no writer can need any more at ``now``, and stale index entries
        (``cas.refs.fences``): what GC removes."""
        return [entry for entry in fences.read_fences(self.blobs) if entry.removable(now)]

    def remove_fence(self, entry: FenceEntry) -> bool:
        """Remove a fence record ``stale_fences`` listed, unless it changed since; whether it went."""
        return fences.remove(self.blobs, entry)

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
        touches after this probe has an mtime at or after it, whatever the host clocks say. The
        probe also measures this host's offset to that clock (``storage``), which the lock,
        sweep windows and lease judgements use: ClockSkew if it cannot be measured closely
        enough for the margin. Falls back to this host's clock where the store cannot be
        written (a read-only store, which GC cannot change anyway).
        """
        try:
            return self.storage.sync(
                self.blobs, CLOCK_PROBE_KEY, lambda: self.blobs.put(CLOCK_PROBE_KEY, b"gc")
            )
        except ClockSkew:
            raise
        except CASError:
            return self.clock()


def _state_key(name: str) -> str:
    if not _STATE_NAME_RE.fullmatch(name):
        raise ValueError(f"bad maintenance state name {name!r}")
    return STATE_PREFIX + name
