"""The quarantine area: objects found corrupt are moved aside, with a record of what was found.

An object that fails verification is copied to ``quarantine/`` and then deleted from its own key,
so the store no longer answers "present" for it: the next save, put or push of the same bytes
writes them again (create-only, like any new object) and heals every checkpoint that names them.
Layout, one directory per object and one pair of blobs per time it was found corrupt::

    quarantine/<kind>/<digest>/<stamp>-<nonce>.obj    the bytes as they were found
    quarantine/<kind>/<digest>/<stamp>-<nonce>.json   the record (``QuarantineRecord``)

``<kind>`` is ``chunks`` or ``manifests``; ``<stamp>`` is the UTC time ``YYYYmmddTHHMMSSZ``. No
key under ``quarantine/`` has the shape of an object key, so listings of objects, GC and
transfers never see them. Only ``BlobStore`` operations are used, so it works on every backend.

The move is safe against a writer that stores a good copy meanwhile: the bytes are read with
their version, checked again, and deleted only by ``delete_conditional`` on that version, so a
replaced blob stays and the copy set aside is dropped. A store that cannot be written (read-only)
cannot quarantine: the reader's ``IntegrityError`` is raised all the same.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from cas.blobstore.base import BlobStore
from cas.digest import Digest
from cas.errors import CASError, FormatError, IntegrityError, NotFound, PreconditionFailed
from cas.model.bounded import load_record_json
from cas.objects.keys import ObjectKind, object_key

log = logging.getLogger(__name__)

QUARANTINE_PREFIX = "quarantine/"
RECORD_SUFFIX = ".json"
BLOB_SUFFIX = ".obj"

Fault = Callable[[bytes], str | None]
"""``fault(blob)``: what is wrong with the stored bytes ``blob`` themselves, or None when they are
fine or the fault cannot be pinned on them (a delta whose base is bad)."""


@dataclass(frozen=True)
class QuarantineRecord:
    """What was found about one object, when, and by which operation."""

    kind: str
    """``chunks`` or ``manifests``."""
    digest: str
    found_at: float
    """Seconds since the epoch."""
    operation: str
    """The object-store operation that found it: ``read``, ``verify``, ``copy``."""
    detail: str
    stored_size: int
    host: str
    pid: int
    key: str = ""
    """Where the bytes were set aside (the ``.obj`` blob); not stored in the record itself."""


@dataclass(frozen=True)
class QuarantineSummary:
    """How much the quarantine area holds (from one listing; no record is read)."""

    objects: int
    """Distinct chunks and manifests quarantined (some may have been healed since)."""
    records: int
    """Times an object was moved aside."""
    stored_bytes: int


def quarantine_prefix(kind: ObjectKind, digest: Digest) -> str:
    """The directory of one object's quarantine entries."""
    return f"{QUARANTINE_PREFIX}{kind.value}/{digest}/"


class Quarantine:
    """The quarantine area of one store."""

    def __init__(self, blobs: BlobStore, clock: Callable[[], float] = time.time) -> None:
        self.blobs = blobs
        self.clock = clock

    def move_aside(
        self, kind: ObjectKind, digest: Digest, fault: Fault, operation: str
    ) -> QuarantineRecord | None:
        """Move the object aside if its stored bytes are still faulty; the record, or None when
        nothing was moved (gone, good again, not its own fault, or the store refused writes)."""
        key = object_key(kind, digest)
        try:
            blob, version = self.blobs.get_versioned(key)
        except CASError:
            return None
        detail = fault(blob)
        if detail is None:
            return None
        now = self.clock()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        base = f"{quarantine_prefix(kind, digest)}{stamp}-{uuid.uuid4().hex[:8]}"
        record = QuarantineRecord(
            kind.value, digest, now, operation, detail, len(blob), socket.gethostname(), os.getpid()
        )
        doc = {k: v for k, v in asdict(record).items() if k != "key"}
        try:
            self.blobs.put(base + BLOB_SUFFIX, blob)
            self.blobs.put(base + RECORD_SUFFIX, json.dumps(doc, sort_keys=True).encode())
            self.blobs.sync()  # the evidence is durable before the object leaves its key
        except CASError as e:  # read-only, or the backend refused: the reader still raises
            log.debug("cas: cannot quarantine %s: %s", key, e)
            return None
        try:
            self.blobs.delete_conditional(key, version)
        except (PreconditionFailed, NotFound):
            # Replaced by another writer (a healing save) or moved by another reader: keep
            # what is there now, and no second record of the same find.
            self._discard(base)
            return None
        except CASError as e:
            log.warning("cas: cannot move corrupt %s aside: %s", key, e)
            self._discard(base)
            return None
        self.blobs.drop_cached(key)
        log.info("cas: %s %s is corrupt (%s); moved to %s", kind.noun, digest, detail, base)
        return QuarantineRecord(**{**doc, "key": base + BLOB_SUFFIX})

    def found_corrupt(
        self, kind: ObjectKind, digest: Digest, error: IntegrityError, operation: str, fault: Fault
    ) -> IntegrityError:
        """Quarantine the object if ``fault`` pins ``error`` on its stored bytes; the error for
        the reader to raise, saying where the bytes went."""
        record = self.move_aside(kind, digest, fault, operation)
        if record is None:
            return error
        return IntegrityError(f"{error}; moved aside to {record.key}")

    def explain_missing(self, kind: ObjectKind, digest: Digest, error: NotFound) -> CASError:
        """An IntegrityError for an object that is missing because it was quarantined, else
        ``error``: a reader asked for it because a manifest names it, so it is damage."""
        try:
            records = self.records_of(kind, digest)
        except CASError:
            return error
        if not records:
            return error
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(records[-1].found_at))
        return IntegrityError(
            f"{kind.noun} {digest} was found corrupt ({records[-1].detail}) and quarantined "
            f"at {when}; saving the same data again or `cas verify --full --repair-from URL` "
            "restores it"
        )

    def _discard(self, base: str) -> None:
        for suffix in (BLOB_SUFFIX, RECORD_SUFFIX):
            try:
                self.blobs.delete(base + suffix)
            except CASError as e:
                log.debug("cas: cannot remove %s%s: %s", base, suffix, e)

    def summary(self) -> QuarantineSummary:
        """Counts and bytes of what the quarantine area holds."""
        objects: set[tuple[str, str]] = set()
        records = stored = 0
        for info in self.blobs.list_info(QUARANTINE_PREFIX):
            parts = info.key.split("/")
            if len(parts) == 4:
                objects.add((parts[1], parts[2]))
            records += info.key.endswith(RECORD_SUFFIX)
            stored += info.size
        return QuarantineSummary(len(objects), records, stored)

    def records_of(self, kind: ObjectKind, digest: Digest) -> list[QuarantineRecord]:
        """Every time this object was quarantined, oldest first."""
        return sorted(self._records(quarantine_prefix(kind, digest)), key=lambda r: r.found_at)

    def records(self) -> Iterator[QuarantineRecord]:
        """Every quarantine record of the store, in no particular order."""
        return self._records(QUARANTINE_PREFIX)

    def _records(self, prefix: str) -> Iterator[QuarantineRecord]:
        for info in self.blobs.list_info(prefix):
            if not info.key.endswith(RECORD_SUFFIX):
                continue
            try:
                doc = load_record_json(self.blobs.get(info.key), f"quarantine record {info.key}")
                record = QuarantineRecord(
                    **{**doc, "key": info.key.removesuffix(RECORD_SUFFIX) + BLOB_SUFFIX}
                )
                if not isinstance(record.found_at, (int, float)):
                    raise TypeError("found_at is not a number")
            except (CASError, ValueError, TypeError) as e:
                # A damaged record still says that something was quarantined here.
                log.debug("cas: unreadable quarantine record %s: %s", info.key, e)
                yield _unreadable(info.key, info.size)
            else:
                yield record


def _unreadable(key: str, size: int) -> QuarantineRecord:
    parts = key.split("/")
    kind, digest = (parts[1], parts[2]) if len(parts) >= 4 else ("", "")
    detail = str(FormatError(f"unreadable quarantine record {key}"))
    blob_key = key.removesuffix(RECORD_SUFFIX) + BLOB_SUFFIX
    return QuarantineRecord(kind, digest, 0.0, "", detail, size, "", 0, blob_key)
