"""Writer leases: how writers tell GC what is in flight.

A writer (``Repository.save``, ``put_path``, ``commit``...) holds a *lease* for the length of the
write: a small JSON blob ``leases/<writer-id>`` saying who holds it (host, pid), when it started
and when it expires. A daemon thread renews it while the writer lives (``cas.refs.renewal``); it is
checked right before each ref compare-and-swap (``RefStore`` does it; ``LeaseExpired`` aborts the
commit) and deleted afterwards.

GC reads the leases before it lists anything. A live lease protects every object modified after
``lease.started - margin``: everything the writer wrote or reused (``put_chunk`` of an existing
chunk refreshes its mtime) has an mtime at or after ``started``. A writer whose lease GC saw as
expired can no longer commit, because the writer stops committing ``margin`` seconds *before*
expiry and GC treats a lease as live until ``margin`` seconds *after* it; ``margin`` therefore
covers the clock skew between hosts (and the server's clock for S3 mtimes) plus the time of one
ref compare-and-swap. Every time in a lease is the storage's (``cas.refs.storage_clock``): a
writer measures its offset to the storage's clock from the lease blob it just wrote, so ``margin``
covers only what that measurement leaves. See docs/gc.md ("Writer leases", "Clocks") for the whole
protocol. The maintenance
lock of ``cas forget`` / ``cas gc`` is the same idea for maintenance runs (``cas.refs.maintenance``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from cas.blobstore.base import BlobStore, Version
from cas.errors import CASError, ClockSkew, FormatError, LeaseExpired, NotFound
from cas.model.bounded import load_record_json
from cas.names import RefName
from cas.refs import fences
from cas.refs.liveness import UNKNOWN, ProcessIdentity, current
from cas.refs.renewal import Renewal, start_renewal
from cas.refs.storage_clock import StorageClock
from cas.refs.sweeps import IDLE, SweepState, read_sweep, settle

LEASES_PREFIX = "leases/"
LEASE_FORMAT = "cas-lease"
LEASE_SECTION = "leases"
"""The ``StoreConfig.extra`` section holding ``LeaseSettings``."""
MAX_LEASE_BLOB = 64 << 10
RENEWALS_PER_DURATION = 4
"""A live writer's lease is renewed every ``duration / 4``, so it rides out a failed renewal, or
a stall of up to ``3/4 duration - margin`` (a minute by default), before it is lost."""

Progress = Callable[[int], None]


@dataclass(frozen=True)
class LeaseSettings:
    """How long a writer lease lasts and how much clock slack both sides allow.

    ``duration``: a lease not renewed for this long expires (a writer's renewal thread renews it
    every quarter of it while the writer lives; the maintenance lock lasts as long). ``margin``:
    writers stop committing this long before expiry and GC keeps honouring a lease this long
    after it, so it must exceed the clock skew between any writer, the GC host and the storage
    server, plus one ref update. A dead remote writer's lease lapses ``duration + margin`` after
    its last renewal at the latest (docs/gc.md, "Writer leases", explains the figures).
    """

    duration: float = 120.0
    margin: float = 30.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.duration <= 0 or self.margin < 0 or 2 * self.margin >= self.duration:
            raise ValueError(
                f"lease duration {self.duration}s must be positive and more than twice the "
                f"margin {self.margin}s, or no writer could ever commit"
            )

    @classmethod
    def from_config(cls, extra: dict[str, Any]) -> LeaseSettings:
        """Settings from ``StoreConfig.extra["leases"]`` (defaults for what is missing)."""
        section = extra.get(LEASE_SECTION) or {}
        if not isinstance(section, dict):
            raise FormatError("store config: 'leases' must be a map")
        known = {k: section[k] for k in ("duration", "margin", "enabled") if k in section}
        try:
            return cls(**known)
        except (TypeError, ValueError) as e:
            raise FormatError(f"store config: bad 'leases' section: {e}") from e


@dataclass(frozen=True)
class LeaseRecord:
    """A lease as GC reads it from the store."""

    key: str
    writer: str
    who: ProcessIdentity
    """The writer's process: host, pid, boot id, PID namespace, start time (``cas.refs.liveness``)."""
    started: float
    expires: float
    purpose: str
    version: Version | None
    readable: bool = True
    """False when the blob could not be parsed; GC then treats it conservatively."""
    commits: tuple[str, ...] = ()
    """Refs the writer declared it is about to move: GC fences them once the lease expired."""

    def live(self, now: float, margin: float) -> bool:
        """Whether GC must still honour it at ``now`` (until ``margin`` after its expiry), and
        its writer may still be running: a lease whose writer is certainly dead lapses at once."""
        return now < self.expires + margin and not self.writer_gone()

    def writer_gone(self) -> bool:
        """Whether the writer is certainly dead: same host, boot and PID namespace as this
        process, and its process is gone."""
        return self.readable and self.who.gone()

    @property
    def host(self) -> str:
        """The writer's host name."""
        return self.who.host

    @property
    def pid(self) -> int:
        """The writer's pid (in its own PID namespace)."""
        return self.who.pid


def writer_id() -> str:
    """A name for this process's writer, unique across hosts and restarts."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def encode_json(doc: dict[str, Any]) -> bytes:
    """The canonical JSON bytes of a lease or lock document."""
    return json.dumps(doc, sort_keys=True).encode()


class WriterLease:
    """One writer's lease: acquire, renewed while the writer lives, checked before committing,
    released.

    A daemon thread renews it every quarter of its duration (``cas.refs.renewal``), so a writer
    that is alive but idle (a slow disk, a long wait between chunks) keeps it. A renewal counts
    only if its write returned while the lease it extends was still safely live: a write that
    returned later may have landed after GC read the lease and found it expired, so the lease is
    lost for good instead, and no later renewal or commit revives it (docs/gc.md, "Writer leases").
    """

    def __init__(
        self,
        blobs: BlobStore,
        storage: StorageClock,
        settings: LeaseSettings,
        purpose: str = "write",
    ) -> None:
        self.blobs = blobs
        self.storage = storage
        self.clock = storage.now
        """Storage time: every time this lease writes or checks is the storage's."""
        self.settings = settings
        self.purpose = purpose
        self.writer_id = writer_id()
        self.key = LEASES_PREFIX + self.writer_id
        self.started = 0.0
        self.expires = 0.0
        self._refreshed = 0.0
        self._lost = ""
        self._released = False
        self._renew_error = ""
        self._renewal: Renewal | None = None
        self._lock = threading.Lock()
        self.commits: tuple[str, ...] = ()
        self.sweep: SweepState = IDLE
        """GC's sweep record as it was when the lease was taken (``cas.refs.sweeps``)."""

    def _document(self, now: float) -> bytes:
        return encode_json(
            {
                "format": LEASE_FORMAT,
                "version": 1,
                "writer": self.writer_id,
                **current().fields(),
                "started": self.started,
                "refreshed": now,
                "expires": now + self.settings.duration,
                "purpose": self.purpose[:200],
                "commits": list(self.commits),
            }
        )

    def _first_write(self) -> None:
        now = self.clock()
        self.blobs.put_transient(self.key, self._document(now))
        self._refreshed = now
        self.expires = now + self.settings.duration

    # Plain puts, not compare-and-swap: the key is unique to this writer, and a local store keeps
    # one lock file per conditionally written key forever (one per save would pile up). Transient
    # ones: a lease only matters while its writer runs, so a crash that loses or tears it loses
    # nothing (GC reads an unreadable lease as started at its mtime, which keeps it safe).

    def _write(self, now: float, deadline: float) -> None:
        """Write the lease as of ``now``; the new expiry counts only if the write returned before
        ``deadline`` (the old expiry less the margin), else the lease is lost (held lock)."""
        self.blobs.put_transient(self.key, self._document(now))
        returned = self.clock()
        if returned >= deadline:
            self._lost = (
                f"a lease write returned at {returned:.3f}, after the lease it extended was "
                f"safe ({deadline:.3f}); GC may have found it expired meanwhile"
            )
            raise LeaseExpired(f"writer lease {self.writer_id}: {self._lost}; commit aborted")
        self._refreshed = now
        self.expires = now + self.settings.duration

    def acquire(self) -> WriterLease:
        """Write the lease blob, measuring the offset to the storage's clock from it (ClockSkew
        if that cannot be done closely enough), read GC's sweep record and start renewing; from
        now on GC spares what this writer touches, and its commits can tell whether a deletion
        overlapped them."""
        with self._lock:
            before = self.storage.offset
            self.started = self.clock()
            try:
                self.storage.sync(self.blobs, self.key, self._first_write)
            except ClockSkew:
                with contextlib.suppress(CASError):
                    self.blobs.delete(self.key)
                raise
            after = self.storage.offset
            # The first write used the offset known before (none: this host's clock as is).
            used = before.value if before is not None else 0.0
            off = math.inf if after is None else abs(after.value - used) + after.uncertainty
            if off > self.storage.limit:
                # Its times may be further off the storage's than the margin allows (this
                # host's clock is off, or was stepped): write it again in storage time before
                # touching any object, so any GC that reads the lease after this writer's first
                # touch sees the right times.
                now = self.clock()
                self.started = now
                self._write(now, now + self.settings.duration - self.settings.margin)
        self.sweep = read_sweep(self.blobs)
        period = self.settings.duration / RENEWALS_PER_DURATION
        self._renewal = start_renewal(self, WriterLease._renew_in_background, period, "lease")
        return self

    def declare(self, ref: str) -> None:
        """Record in the lease blob that this writer is about to move ``ref``, before it reads
        the ref for the compare-and-swap: GC fences the refs of a lease it finds expired, so a
        writer paused past its lease can never publish (docs/gc.md, "Fenced commits")."""
        with self._lock:
            if ref in self.commits:
                return
            now = self.clock()
            self._raise_if_expired(now)
            self.commits = (*self.commits, ref)
            self._write(now, self.expires - self.settings.margin)

    def settle(self, missing: Callable[[], Iterable[str]]) -> None:
        """LeaseExpired if a GC deletion that overlapped this write took an object the commit
        names; ``missing()`` lists those that are gone (asked only after an overlap)."""
        settle(self.blobs, self.sweep, self.clock, self.settings.margin, missing)

    def refresh(self) -> None:
        """Extend the lease by ``duration``; LeaseExpired if it already ran out, GC reaped it or
        it was released."""
        with self._lock:
            now = self.clock()
            self._raise_if_expired(now)
            if not self.blobs.has(self.key):
                self._lost = "its lease blob is gone (reaped by GC as expired)"
                raise LeaseExpired(f"writer lease {self.writer_id}: {self._lost}; commit aborted")
            self._write(now, self.expires - self.settings.margin)

    @staticmethod
    def _renew_in_background(lease: WriterLease) -> bool:
        """One renewal by the renewal thread; False ends the thread (lost or released). A failed
        write is remembered for the error the writer sees if its lease then runs out."""
        try:
            lease.refresh()
        except LeaseExpired:
            return False
        except CASError as e:
            lease._renew_error = f"renewing the lease failed: {e}"
            return True
        lease._renew_error = ""
        return True

    def maybe_refresh(self) -> None:
        """Refresh when a quarter of the duration passed since the last refresh (progress on the
        writer's own thread; the renewal thread usually did it already)."""
        if self.clock() - self._refreshed >= self.settings.duration / RENEWALS_PER_DURATION:
            self.refresh()

    def check(self) -> None:
        """Raise LeaseExpired unless the lease is safely live (``margin`` before its expiry)."""
        with self._lock:
            self._raise_if_expired(self.clock())

    def _raise_if_expired(self, now: float) -> None:
        if self._released:
            raise LeaseExpired(f"writer lease {self.writer_id} was released; commit aborted")
        if self._lost:
            raise LeaseExpired(f"writer lease {self.writer_id}: {self._lost}; commit aborted")
        if now >= self.expires - self.settings.margin:
            why = f" ({self._renew_error})" if self._renew_error else ""
            self._lost = (
                f"expired at {self.expires:.3f} (now {now:.3f}, margin {self.settings.margin:g}s)"
                f"{why}; GC may already have collected what this writer stored"
            )
            raise LeaseExpired(f"writer lease {self.writer_id} {self._lost}; commit aborted")

    def release(self) -> None:
        """Stop renewing and delete the lease blob; a lease that was lost also withdraws from the
        fences GC put on the refs it declared. Failures only leave a lease that will expire."""
        with self._lock:
            if self._released:
                return
            self._released = True
            lapsed = bool(self._lost) or self.clock() >= self.expires - self.settings.margin
        if self._renewal is not None:
            self._renewal.stop()
            self._renewal = None
        # An unreleased lease expires by itself; a failure here must not mask the write's result.
        with contextlib.suppress(CASError):
            self.blobs.delete(self.key)
        if lapsed:
            # Only a lease that lapsed can have been fenced: GC fences a lease it found expired,
            # and then this writer finds it expired too.
            for ref in self.commits:
                fences.withdraw(self.blobs, RefName(ref), self.writer_id)


class LeaseManager:
    """Per-thread, re-entrant writer leases for one Repository (``save`` calls ``commit``)."""

    def __init__(
        self, blobs: BlobStore, clock: Callable[[], float], settings: LeaseSettings
    ) -> None:
        self.blobs = blobs
        self.clock = clock
        """This host's clock (injected in tests)."""
        self.settings = settings
        self.storage = StorageClock(clock, settings.margin)
        """The storage's clock as this host knows it, shared with the maintenance service."""
        self._local = threading.local()
        self._active: weakref.WeakSet[WriterLease] = weakref.WeakSet()

    def current(self) -> WriterLease | None:
        """The lease this thread holds, if any."""
        lease: WriterLease | None = getattr(self._local, "lease", None)
        return lease

    def acquire(self, purpose: str) -> WriterLease | None:
        """A lease owned by the caller rather than this thread, for writes that outlive one call
        (a file open for writing); None when leases are disabled. The caller refreshes, checks
        and releases it."""
        if not self.settings.enabled:
            return None
        lease = WriterLease(self.blobs, self.storage, self.settings, purpose).acquire()
        self._active.add(lease)
        return lease

    def close(self) -> None:
        """Release every lease still held (a file left open for writing): their renewal threads
        stop and their writes can no longer commit."""
        for lease in list(self._active):
            lease.release()

    @contextmanager
    def using(self, lease: WriterLease | None) -> Iterator[None]:
        """Make a caller-owned lease (``acquire``) this thread's for the block, so a commit in it
        declares its ref in that lease and settles against GC's sweeps like a save's commit.
        A lease this thread already holds stays in charge."""
        if lease is None or self.current() is not None:
            yield
            return
        self._local.lease = lease
        try:
            yield
        finally:
            self._local.lease = None

    @contextmanager
    def hold(self, purpose: str = "write") -> Iterator[WriterLease | None]:
        """Hold a lease for the block (re-entrant: an inner ``hold`` reuses the outer lease).

        Wrap a ``write_tensors`` ... ``commit`` sequence in one ``hold`` so the chunks written
        first stay protected until the commit.
        """
        existing = self.current()
        if existing is not None or not self.settings.enabled:
            yield existing
            return
        lease = WriterLease(self.blobs, self.storage, self.settings, purpose).acquire()
        self._active.add(lease)
        self._local.lease = lease
        try:
            yield lease
        finally:
            self._local.lease = None
            lease.release()

    def check(self) -> None:
        """LeaseExpired if this thread's lease is no longer safely live (no-op without one)."""
        lease = self.current()
        if lease is not None:
            lease.check()

    def declare(self, ref: str) -> None:
        """Declare in this thread's lease the ref it is about to move (no-op without one)."""
        lease = self.current()
        if lease is not None:
            lease.declare(ref)

    def settle(self, missing: Callable[[], Iterable[str]]) -> None:
        """This thread's commit check against GC's sweeps (no-op without a lease)."""
        lease = self.current()
        if lease is not None:
            lease.settle(missing)

    def beat(self, progress: Progress | None) -> Progress | None:
        """Wrap a progress callback so each unit of progress refreshes this thread's lease.

        The wrapper runs on I/O worker threads, so it captures the lease now.
        """
        lease = self.current()
        if lease is None:
            return progress

        def beat_and_report(n: int) -> None:
            lease.maybe_refresh()
            if progress is not None:
                progress(n)

        return beat_and_report


class _HasLeases(Protocol):
    leases: LeaseManager


S = TypeVar("S", bound=_HasLeases)
P = ParamSpec("P")
R = TypeVar("R")


def leased(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Decorate a Repository write method so it runs holding a writer lease."""

    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.leases.hold(method.__name__):
            return method(self, *args, **kwargs)

    functools.update_wrapper(wrapper, method)
    return wrapper


def read_leases(
    blobs: BlobStore, default_duration: float = LeaseSettings.duration
) -> list[LeaseRecord]:
    """Every lease in the store. An unreadable one counts as started at its mtime, to be safe."""
    records = []
    for info in blobs.list_info(LEASES_PREFIX):
        try:
            data, version = blobs.get_versioned(info.key)
        except NotFound:
            continue  # released between list and get
        records.append(_parse_lease(info.key, data, version, info.mtime, default_duration))
    return records


def _parse_lease(
    key: str, data: bytes, version: Version, mtime: float, default_duration: float
) -> LeaseRecord:
    try:
        doc = load_record_json(data, f"lease {key!r}", MAX_LEASE_BLOB)
        if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT:
            raise ValueError("not a lease")
        return LeaseRecord(
            key,
            str(doc["writer"]),
            ProcessIdentity.from_doc(doc),
            float(doc["started"]),
            float(doc["expires"]),
            str(doc.get("purpose", "")),
            version,
            commits=tuple(str(ref) for ref in doc.get("commits", ())),
        )
    except (FormatError, ValueError, KeyError, TypeError):
        return LeaseRecord(
            key,
            key[len(LEASES_PREFIX) :],
            UNKNOWN,
            mtime,
            mtime + default_duration,
            "?",
            version,
            readable=False,
        )
