"""Refs: mutable names pointing at manifest digests, changed only by compare-and-swap, with history.

``RefStore.update`` is the one door through which a ref moves: read the record and its version,
ask the caller's function what the ref should become, write conditionally on that version, and on
a lost race read again and ask again (dulwich's ``set_if_equals``). ``set`` and ``delete`` are
written with it, and so is every read-modify-write of a ref elsewhere in cas.

A ref's newest ``INLINE_HISTORY`` events live inside its record, so one compare-and-swap moves the
target and logs the move. Older events are sealed, ``SEAL_EVENTS`` at a time, into immutable
history segments (small manifests, docs/format.md) that the record lists by digest. Every update
rewrites the record, so without sealing a ``latest`` ref moved at each save would cost each save
time and bytes in proportion to the run's length: at 10,000 inline events an update took 38 ms of
CPU and rewrote 1.2 MB. With sealing it stays under a millisecond.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from enum import Enum

from cas.blobstore.base import BlobStore, Version
from cas.codecs import codec_by_name
from cas.digest import Digest, parse_digest
from cas.errors import CASError, FormatError, NotFound, PreconditionFailed, RefConflict
from cas.model.manifest import Manifest, decode_manifest, encode_manifest
from cas.names import RefName, check_selector, parse_ref_name, ref_matches
from cas.objects.keys import ObjectKind
from cas.objects.store import ObjectStore
from cas.refs import fences, segments
from cas.refs.keys import (
    is_hashed_key,
    legacy_key,
    listing_prefix,
    plain_name_in_key,
    ref_key,
)
from cas.refs.leases import LeaseManager
from cas.refs.records import (
    FencedRef,
    FencedWriter,
    RefEvent,
    RefRecord,
    SealedHistory,
    decode_ref,
    decode_stored,
    encode_fence,
    encode_ref,
    pack_events,
    unpack_events,
)

MAX_HISTORY = 10_000
"""History is append-only; past this many events, whole sealed segments are dropped oldest first
(at sealing time, so a ref keeps fewer than ``MAX_HISTORY + 2 * SEAL_EVENTS``)."""
INLINE_HISTORY = 128
"""Events kept inside the record; when there are more, the oldest are sealed."""
SEAL_EVENTS = 64
"""Events per sealed segment; after sealing, ``INLINE_HISTORY - SEAL_EVENTS`` or more stay inline."""
REFLOG_MARK = "cas_reflog"
"""The meta key that makes a manifest a sealed history segment."""
DECODED_REFS = 256
"""How many refs' decoded records a RefStore keeps for reuse."""
UPDATE_ATTEMPTS = 64
"""Conditional writes ``RefStore.update`` tries before it gives up with RefConflict."""


_MOVES = itertools.count(1)
_LAST_MOVE: dict[str, int] = {}
"""Per store URL, the number of the latest ref change this process made (through any RefStore
on that URL); ``RefStore.local_change`` reads it for caches of ref names and targets."""


class RefChange(Enum):
    """What an update function returns when the ref should not point at a new target."""

    KEEP = "keep"
    """Leave the ref as it is (absent stays absent); nothing is written."""
    DELETE = "delete"
    """Remove the ref (a no-op when it is already absent)."""


UpdateFn = Callable[["RefRecord | None"], "Digest | RefChange"]
"""Given the ref's current record (None: no such ref), the target it should have next."""


@dataclass(frozen=True)
class ScannedRef:
    """One ref blob as ``RefStore.scan`` found it: its record, or why it cannot be read."""

    key: str
    """Where the record is stored, for messages about a ref whose name cannot be read."""
    record: RefRecord | None
    error: CASError | None = None
    name: RefName | None = None
    """The ref's name when it is known (from the record, or from the key of a damaged one)."""

    @property
    def label(self) -> str:
        """The ref's name, or its blob key when the name cannot be read, for messages."""
        return self.name or self.key


def _ended_since(
    events: tuple[RefEvent, ...], newer_time: float, since: float, back: int
) -> Iterator[tuple[int, RefEvent]]:
    """``(steps back, event)`` for the events that ended at or after ``since``: each ended when
    the next began, the last when the next newer event (``newer_time``) did. ``back``: how many
    events are newer than all of these."""
    for i, event in enumerate(events):
        ended = events[i + 1].time if i + 1 < len(events) else newer_time
        if ended >= since:
            yield back + len(events) - 1 - i, event


class RefStore:
    """Reads refs and moves them through ``update``, on a BlobStore.

    ``leases``: the writer leases of this store's writers. A thread that holds one has it
    checked right before each conditional write, so a writer whose lease expired never moves a
    ref (invariant 11), whichever code path asked for the move.
    """

    def __init__(
        self,
        blobs: BlobStore,
        clock: Callable[[], float] = time.time,
        leases: LeaseManager | None = None,
        *,
        legacy_layouts: bool = True,
    ) -> None:
        self.blobs = blobs
        self.clock = clock
        self.leases = leases
        self.legacy_layouts = legacy_layouts
        """Whether the store may hold layouts an older cas wrote (a store of format version 1):
        only then is a missing long name looked up at its old key, or an eviction log's JSON
        lines listed."""
        self.objects = ObjectStore(blobs)
        self._decoded: dict[RefName, RefRecord] = {}
        """The last record read or written per ref, reused while the blob's version is the same:
        decoding a record with a long inline history costs more than reading it."""

    @property
    def url(self) -> str:
        """Where the refs live."""
        return self.blobs.url

    def local_change(self) -> int:
        """A number that changes whenever this process creates, moves or removes a ref of this
        store, through this RefStore or another on the same URL (0: none yet). Caches of refs
        compare it to drop what this very process changed; other processes' changes are not
        seen here."""
        return _LAST_MOVE.get(self.url, 0)

    def _changed(self) -> None:
        # After the write: a cache that reads the new number and then lists sees the change.
        _LAST_MOVE[self.url] = next(_MOVES)

    def get(self, name: str) -> RefRecord:
        """The current record of a ref; NotFound if there is none."""
        ref = parse_ref_name(name)
        key = ref_key(ref)
        try:
            data, version = self.blobs.get_versioned(key)
        except NotFound:
            record = self._get_legacy(ref) if self.legacy_layouts else None
            if record is None:
                self._decoded.pop(ref, None)
                raise NotFound(f"no ref named {ref!r}") from None
            return record
        known = self._decoded.get(ref)
        if known is not None and known.version == version and known.legacy_key is None:
            return known
        record = decode_stored(key, data, version)
        if record.name != ref:
            raise FormatError(f"ref blob {key!r} holds the record of another ref, {record.name!r}")
        return self._remember(record)

    def forget_decoded(self) -> None:
        """Drop the records kept for reuse: a record was changed or removed beside ``update``."""
        self._decoded.clear()
        self._changed()

    def _get_legacy(self, ref: RefName) -> RefRecord | None:
        """A long name's record where an older cas stored it, or None."""
        key = legacy_key(ref)
        if key is None:
            return None
        try:
            data, version = self.blobs.get_versioned(key)
        except NotFound:
            return None
        return replace(decode_ref(ref, data, version), legacy_key=key)

    def _remember(self, record: RefRecord) -> RefRecord:
        if len(self._decoded) >= DECODED_REFS and record.name not in self._decoded:
            self._decoded.clear()  # a listing of every ref must not grow this without bound
        self._decoded[record.name] = record
        return record

    def try_get(self, name: str) -> RefRecord | None:
        """The record, or None when the ref does not exist."""
        try:
            return self.get(name)
        except NotFound:
            return None

    def names(self, selector: str = "") -> Iterator[RefName]:
        """Ref names selected by a prefix, exact name or glob, sorted.

        Names are read from keys; only a name too long for its key (``cas.refs.keys``), or a key
        the fence index lists (``cas.refs.fences``), is read from its record, and left out when
        that record is damaged (``scan`` reports it) or is a fence record (no ref).
        """
        found = set()
        keys = self._keys(selector)
        fenced = fences.indexed_keys(self.blobs, self._prefix(selector)) if keys else set()
        for key in keys:
            if is_hashed_key(key) or key in fenced:
                scanned = self._scan_key(key)
                name = scanned.record.name if scanned and scanned.record else None
            else:
                name = plain_name_in_key(key)
            if name is not None and ref_matches(name, selector):
                found.add(name)
        yield from sorted(found)

    def _keys(self, selector: str) -> list[str]:
        return list(self.blobs.list(self._prefix(selector)))

    @staticmethod
    def _prefix(selector: str) -> str:
        return listing_prefix(check_selector(selector).split("*")[0].split("?")[0].split("[")[0])

    def records(self, selector: str = "") -> list[RefRecord]:
        """Records of the refs a prefix, exact name or glob selects, sorted by name; a ref
        removed since the listing is left out. A damaged record raises: ``scan`` lists the
        others and reports it."""
        found = []
        for name in self.names(selector):
            record = self.try_get(name)
            if record is not None:
                found.append(record)
        return found

    def scan(self, selector: str = "", workers: int = 16) -> list[ScannedRef]:
        """The ref blobs ``selector`` (prefix, exact name or glob) selects, read and decoded
        ``workers`` at a time, sorted by name.

        Unlike ``names``, nothing is skipped quietly: a blob whose key names no valid ref, or
        whose record is damaged, is reported with its error, so a caller that must see every
        ref (GC, which could otherwise delete what a damaged ref protects) can keep it, and a
        listing can show every other ref and say which one it could not read. A damaged blob
        whose name is unknown is reported by every selector whose listing reaches its key. A
        ref removed since the listing is left out: it protects nothing any more.
        """
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="cas-refs") as pool:
            found = [r for r in pool.map(self._scan_key, self._keys(selector)) if r is not None]
        chosen: dict[str, ScannedRef] = {}
        for scanned in found:
            if scanned.name is not None and not ref_matches(scanned.name, selector):
                continue
            label = scanned.label
            other = chosen.get(label)
            # A long name an older cas stored, and moved by this one, may briefly have both
            # keys: the current key wins.
            if other is None or scanned.key == ref_key(RefName(label)):
                chosen[label] = scanned
        return sorted(chosen.values(), key=lambda r: r.label)

    def _scan_key(self, key: str) -> ScannedRef | None:
        name = None if is_hashed_key(key) else plain_name_in_key(key)
        try:
            data, version = self.blobs.get_versioned(key)
            record = decode_stored(key, data, version)
        except NotFound:
            return None
        except CASError as e:
            return ScannedRef(key, None, e, name)
        if record.name == name and key != ref_key(record.name):
            record = replace(record, legacy_key=key)
        return ScannedRef(key, record, None, record.name)

    def update(
        self,
        name: str,
        fn: UpdateFn,
        *,
        op: str,
        message: str = "",
        attempts: int = UPDATE_ATTEMPTS,
    ) -> RefRecord | None:
        """Move ``name`` to what ``fn`` decides, by compare-and-swap; the one way a ref changes.

        ``fn(current)`` gets the record as just read (None when there is no such ref) and returns
        the new target digest, ``RefChange.DELETE`` or ``RefChange.KEEP``; it may raise to abort,
        and the exception reaches the caller unchanged. The write is conditional on the version
        ``fn`` saw: when another writer got in between, the record is read again and ``fn`` is
        called again with it, so ``fn`` must be safe to repeat (objects it stores and then
        abandons are left to GC); a write of ours that landed although it was reported lost (a
        retried request whose reply went missing) is known by its event in the record read
        again, and ends the update. After ``attempts`` lost races: RefConflict naming the ref
        and ``op``. ``op`` and ``message`` are recorded in the ref's history.

        Returns the record as this call left it: the new one, the current one for KEEP, None
        when the ref is (now) absent.
        """
        ref = parse_ref_name(name)
        if attempts < 1:
            raise ValueError("a ref update needs at least one attempt")
        if self.leases is not None:
            self.leases.declare(ref)  # before the read the compare-and-swap depends on
        ours: RefEvent | None = None
        for _ in range(attempts):
            current, version = self._current(ref)
            if ours is not None and current is not None and ours in current.history:
                # Our write landed and its answer was lost: the event, stamped with this call's
                # time, is in the record. Deciding again would record it twice.
                return current
            decision = fn(current)
            if decision is RefChange.KEEP:
                return current
            try:
                if decision is RefChange.DELETE:
                    if current is not None:
                        self._delete_record(current)
                    return None
                moved = self._moved(ref, current, decision, op, message)
                ours = moved.history[-1]
                return self._write_record(moved, current, version)
            except (PreconditionFailed, NotFound):
                continue  # another writer got in between: decide again on its record
        raise RefConflict(
            f"ref {ref!r} kept changing: {op} lost the compare-and-swap to other writers "
            f"{attempts} times, gave up"
        )

    def _moved(
        self, ref: RefName, current: RefRecord | None, target: Digest, op: str, message: str
    ) -> RefRecord:
        """The record after pointing ``ref`` at ``target``, its history extended (and sealed)."""
        event = RefEvent(parse_digest(target), self.clock(), op, message)
        if current is None:
            return RefRecord(ref, event.target, (event,))
        record = replace(current, target=event.target, history=(*current.history, event))
        if len(record.history) > INLINE_HISTORY:
            record = self._seal(record)
        return record

    def _current(self, ref: RefName) -> tuple[RefRecord | None, Version | None]:
        """The record (None: absent) and the version a compare-and-swap must expect."""
        try:
            record = self.get(ref)
        except FencedRef as e:
            return None, e.version
        except NotFound:
            return None, None
        return record, record.version

    def _check_lease(self) -> None:
        if self.leases is not None:
            self.leases.check()  # a writer whose lease expired must not publish (invariant 11)

    def _write_record(
        self, record: RefRecord, current: RefRecord | None, expected: Version | None
    ) -> RefRecord:
        if self.leases is not None:
            self.leases.settle(lambda: self._missing(record))
        self._check_lease()
        record = replace(record, legacy_key=None)
        if current is not None and current.legacy_key is not None:
            # Create the current key, then drop the old one; a crash in between leaves both,
            # and the current key wins every read.
            version = self.blobs.put_conditional(ref_key(record.name), encode_ref(record), None)
            assert current.version is not None
            self.blobs.delete_conditional(current.legacy_key, current.version)
        else:
            version = self.blobs.put_conditional(ref_key(record.name), encode_ref(record), expected)
        self._changed()
        return self._remember(replace(record, version=version, ignored_history=0))

    def _missing(self, record: RefRecord) -> list[str]:
        """Objects ``record`` names (target manifest, its chunks, sealed history) that are gone."""
        manifests = [record.target, *(s.digest for s in record.sealed)]
        present = self.objects.has_many(ObjectKind.MANIFEST, manifests)
        gone = [f"manifest {d}" for d, ok in present.items() if not ok]
        if present[record.target]:
            chunks = decode_manifest(self.objects.get_manifest(record.target)).chunk_digests()
            found = self.objects.has_many(ObjectKind.CHUNK, chunks)
            gone.extend(f"chunk {d}" for d, ok in found.items() if not ok)
        return gone

    def fence(
        self, name: str, writers: tuple[FencedWriter, ...] = (), at: float = 0.0
    ) -> Digest | None:
        """Change ``name``'s blob so that a compare-and-swap prepared before now fails: GC's fence
        of a commit an expired lease declared. The record stays as it was, with a fresh token; an
        absent ref gets a fence record naming ``writers`` (added to those of a fence already
        there), indexed first so no listing shows it. Returns the ref's target (None: absent)."""
        ref = parse_ref_name(name)
        for _ in range(UPDATE_ATTEMPTS):
            token = uuid.uuid4().hex
            current: RefRecord | None = None
            version: Version | None = None
            try:
                current = self.get(ref)
                version = current.version
            except FencedRef as e:
                version, at = e.version, e.at or at
                known = {w.writer for w in e.writers}
                writers = (*e.writers, *(w for w in writers if w.writer not in known))
            except NotFound:
                pass
            if current is None:
                self.blobs.put(fences.index_key(ref_key(ref)), b"")
                data = encode_fence(ref, token, writers, at)
            else:
                data = encode_ref(current, fence=token)
                if current.legacy_key is not None:
                    version = None  # a long name's record still at its old key: the new key wins
            try:
                self.blobs.put_conditional(ref_key(ref), data, version)
            except (PreconditionFailed, NotFound):
                continue  # a writer moved it meanwhile: fence what it wrote
            self._decoded.pop(ref, None)
            self._changed()
            return current.target if current else None
        raise RefConflict(f"ref {ref!r} kept changing: gc could not fence it")

    def relocate(self, name: str) -> bool:
        """Move a long name's record from the key an older cas used to its current key, history
        and all, without a new event; False when there was nothing at the old key.

        Creates the current key, then deletes the old one only if it still holds what was
        copied: a crash in between leaves both (the current key wins every read), and a rerun
        finishes the move. A writer that moved the ref meanwhile has done the move itself.
        """
        ref = parse_ref_name(name)
        found = self._get_legacy(ref)
        if found is None or found.legacy_key is None or found.version is None:
            return False
        record = replace(found, legacy_key=None)
        with contextlib.suppress(PreconditionFailed):
            self.blobs.put_conditional(ref_key(ref), encode_ref(record), None)
        with contextlib.suppress(PreconditionFailed, NotFound):
            self.blobs.delete_conditional(found.legacy_key, found.version)
        self._decoded.pop(ref, None)
        self._changed()
        return True

    def _delete_record(self, current: RefRecord) -> None:
        self._check_lease()
        assert current.version is not None
        self.blobs.delete_conditional(current.legacy_key or ref_key(current.name), current.version)
        self._decoded.pop(current.name, None)
        self._changed()

    def set(
        self,
        name: str,
        target: Digest,
        *,
        expected: Digest | object | None = ...,
        op: str = "set",
        message: str = "",
    ) -> RefRecord:
        """Point ``name`` at ``target`` through ``update``.

        ``expected`` is the target the caller believes is current (``None``: the ref must not
        exist); if the ref holds something else, RefConflict, and nothing is written. Left out,
        the ref moves whatever it points at; a concurrent update is still never lost: it stays
        in the ref's history, because the write is conditional on the record just read.
        """
        ref = parse_ref_name(name)
        record = self.update(ref, pointing(ref, target, expected), op=op, message=message)
        assert record is not None
        return record

    def _seal(self, record: RefRecord) -> RefRecord:
        """Move the oldest inline events into sealed segments, made durable before the record
        that lists them is written; drop the oldest segments beyond ``MAX_HISTORY``.

        A segment whose record update then loses its compare-and-swap is an unreferenced
        manifest, which GC removes after the grace period like any other.
        """
        history, sealed = record.history, list(record.sealed)
        while len(history) > INLINE_HISTORY:
            events, history = history[:SEAL_EVENTS], history[SEAL_EVENTS:]
            superseded = [e.time for e in (*events[1:], history[0])]
            segment = Manifest(
                kind="state",
                tensors=(),
                meta={REFLOG_MARK: 1, "ref": record.name, "events": pack_events(events)},
                created_at=events[-1].time,
            )
            digest = self.objects.put_manifest(encode_manifest(segment), codec_by_name("zstd"))
            sealed.append(SealedHistory(digest, len(events), max(superseded)))
        while sealed and len(history) + sum(s.count for s in sealed[1:]) >= MAX_HISTORY:
            del sealed[0]
        self.blobs.sync()
        return replace(record, history=history, sealed=tuple(sealed))

    def segment(self, record: RefRecord, sealed: SealedHistory) -> tuple[RefEvent, ...]:
        """The events of one of ``record``'s sealed segments, oldest first, verified."""
        where = f"ref {record.name!r}: history segment {sealed.digest}"
        try:
            meta = decode_manifest(self.objects.get_manifest(sealed.digest)).meta
        except CASError as e:
            raise type(e)(f"{where}: {e}") from e
        if meta.get(REFLOG_MARK) != 1 or meta.get("ref") != record.name:
            raise FormatError(f"{where} is not a history segment of this ref")
        try:
            events = unpack_events(meta["events"])
        except Exception as e:
            raise FormatError(f"{where} is corrupt: {e}") from e
        return tuple(segments.check_count(events, sealed, where))

    def events(self, record: RefRecord) -> Iterator[RefEvent]:
        """The ref's whole history, newest first; sealed segments are read as the walk gets there."""
        return segments.newest_first(
            record.history, record.sealed, lambda sealed: self.segment(record, sealed)
        )

    def event(self, record: RefRecord, steps: int) -> RefEvent | None:
        """The event ``steps`` back from the current one (0: current), reading one segment at most;
        None beyond the oldest kept."""
        return segments.steps_back(
            record.history, record.sealed, lambda sealed: self.segment(record, sealed), steps
        )

    def superseded_since(
        self, record: RefRecord, now: float, since: float
    ) -> Iterator[tuple[int, RefEvent]]:
        """``(steps back, event)`` for each event the ref moved on from at or after ``since``, the
        current one counting as moved on from ``now``; reads only the segments holding such events.
        """
        yield from _ended_since(record.history, now, since, 0)
        back = len(record.history)
        newer_time = record.history[0].time
        for sealed in reversed(record.sealed):
            if sealed.until >= since:
                events = self.segment(record, sealed)
                yield from _ended_since(events, newer_time, since, back)
                newer_time = events[0].time
            else:
                # Unread: its first event began before it was superseded, before ``since``,
                # so the older segment's last event also ended before ``since``.
                newer_time = -math.inf
            back += sealed.count

    def delete(
        self, name: str, *, expected: Digest | None = None, changed_at: float | None = None
    ) -> RefRecord:
        """Remove a ref through ``update``; return the record that was removed.

        NotFound if there is no such ref. ``expected``: RefConflict unless the ref points there.
        ``changed_at``: also refuse if the ref was set since that time, even to the same target.
        """
        ref = parse_ref_name(name)
        removed: list[RefRecord] = []

        def remove(current: RefRecord | None) -> RefChange:
            if current is None:
                raise NotFound(f"no ref named {ref!r}")
            if expected is not None and current.target != expected:
                raise RefConflict(f"ref {ref!r} moved: expected {_short(expected)}")
            if changed_at is not None and current.history[-1].time != changed_at:
                raise RefConflict(f"ref {ref!r} was set again since {changed_at}")
            removed.append(current)
            return RefChange.DELETE

        self.update(ref, remove, op="delete")
        return removed[-1]


def pointing(ref: RefName, target: Digest, expected: Digest | object | None = ...) -> UpdateFn:
    """The update function of ``RefStore.set``: ``target``, after checking ``expected``."""

    def point(current: RefRecord | None) -> Digest:
        if expected is not ...:
            found = current.target if current else None
            if found != expected:
                raise RefConflict(
                    f"ref {ref!r} moved: expected {_short(expected)}, found {_short(found)}"
                    f"; the new manifest {target} is stored, retry or point a ref at it"
                )
        return target

    return point


def _short(target: object) -> str:
    return str(target)[:12] if target else "nothing"
