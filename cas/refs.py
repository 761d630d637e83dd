"""Refs: mutable names pointing at manifest digests, changed only by compare-and-swap, with history."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote, unquote

import msgpack

from cas.blobstore.base import BlobStore, Version
from cas.digest import Digest, parse_digest
from cas.errors import FormatError, NotFound, PreconditionFailed, RefConflict
from cas.names import RefName, parse_ref_name, ref_matches

REF_FORMAT = "cas-ref"
REF_VERSION = 1
REFS_PREFIX = "refs/"
MAX_HISTORY = 10_000
"""History is append-only up to this many entries; older ones are dropped first."""
MAX_REF_BLOB = 16 << 20


@dataclass(frozen=True)
class RefEvent:
    """One change of a ref: what it pointed at afterwards, when, and why."""

    target: Digest
    time: float
    op: str
    message: str = ""


@dataclass(frozen=True)
class RefRecord:
    """A ref as stored: its current target and its history (oldest first, current last)."""

    name: RefName
    target: Digest
    history: tuple[RefEvent, ...]
    version: Version | None = None
    """The blob version this record was read at; compare-and-swap uses it."""


def ref_key(name: RefName) -> str:
    """The blob key of a ref: one flat directory, '/' escaped, so no name shadows another."""
    return REFS_PREFIX + quote(name, safe="")


def _name_from_key(key: str) -> RefName | None:
    try:
        return parse_ref_name(unquote(key[len(REFS_PREFIX) :]))
    except Exception:
        return None


def encode_ref(record: RefRecord) -> bytes:
    """The msgpack bytes of a ref record."""
    packed: bytes = msgpack.packb(
        {
            "format": REF_FORMAT,
            "version": REF_VERSION,
            "name": record.name,
            "target": record.target,
            "history": [[e.target, e.time, e.op, e.message] for e in record.history],
        }
    )
    return packed


def decode_ref(name: RefName, data: bytes, version: Version | None) -> RefRecord:
    """Parse a ref blob, refusing unknown formats and versions."""
    if len(data) > MAX_REF_BLOB:
        raise FormatError(f"ref {name!r} is larger than {MAX_REF_BLOB} bytes")
    try:
        doc: Any = msgpack.unpackb(data, raw=False)
        if not isinstance(doc, dict) or doc.get("format") != REF_FORMAT:
            raise FormatError(f"ref {name!r} is not a cas ref")
        if doc.get("version") != REF_VERSION:
            raise FormatError(f"ref {name!r} has unsupported version {doc.get('version')!r}")
        history = tuple(
            RefEvent(parse_digest(t), float(ts), str(op), str(msg))
            for t, ts, op, msg in doc["history"]
        )
        return RefRecord(name, parse_digest(doc["target"]), history, version)
    except FormatError:
        raise
    except Exception as e:
        raise FormatError(f"ref {name!r} is corrupt: {e}") from e


class RefStore:
    """Reads and compare-and-swaps refs on a BlobStore."""

    def __init__(self, blobs: BlobStore, clock: Callable[[], float] = time.time) -> None:
        self.blobs = blobs
        self.clock = clock

    def get(self, name: str) -> RefRecord:
        """The current record of a ref; NotFound if there is none."""
        ref = parse_ref_name(name)
        try:
            data, version = self.blobs.get_versioned(ref_key(ref))
        except NotFound:
            raise NotFound(f"no ref named {ref!r}") from None
        return decode_ref(ref, data, version)

    def try_get(self, name: str) -> RefRecord | None:
        """The record, or None when the ref does not exist."""
        try:
            return self.get(name)
        except NotFound:
            return None

    def names(self, selector: str = "") -> Iterator[RefName]:
        """Ref names selected by a prefix, exact name or glob, sorted."""
        literal = selector.split("*")[0].split("?")[0].split("[")[0]
        key_prefix = REFS_PREFIX + quote(literal, safe="")
        found = []
        for key in self.blobs.list(key_prefix):
            name = _name_from_key(key)
            if name is not None and ref_matches(name, selector):
                found.append(name)
        yield from sorted(found)

    def set(
        self,
        name: str,
        target: Digest,
        *,
        expected: Digest | object | None = ...,
        op: str = "set",
        message: str = "",
    ) -> RefRecord:
        """Point ``name`` at ``target`` by compare-and-swap.

        ``expected`` is the target the caller believes is current (``None``: the ref must not
        exist). Left out, the write still cannot lose a concurrent update: it compares against
        the version it just read and raises RefConflict if another writer got in between.
        """
        ref = parse_ref_name(name)
        current = self.try_get(ref)
        if expected is not ...:
            found = current.target if current else None
            if found != expected:
                raise RefConflict(
                    f"ref {ref!r} moved: expected {_short(expected)}, found {_short(found)}"
                    f"; the new manifest {target} is stored, retry or point a ref at it"
                )
        event = RefEvent(target, self.clock(), op, message)
        if current is None:
            record = RefRecord(ref, target, (event,))
        else:
            history = (*current.history, event)[-MAX_HISTORY:]
            record = replace(current, target=target, history=history)
        try:
            version = self.blobs.put_conditional(
                ref_key(ref), encode_ref(record), current.version if current else None
            )
        except PreconditionFailed as e:
            raise RefConflict(
                f"ref {ref!r} was changed by another writer; the new manifest {target} is "
                "stored, retry or point a ref at it"
            ) from e
        return replace(record, version=version)

    def delete(
        self, name: str, *, expected: Digest | None = None, changed_at: float | None = None
    ) -> RefRecord:
        """Remove a ref by compare-and-swap; return the record that was removed.

        ``changed_at``: also refuse if the ref was set since that time, even to the same target.
        """
        current = self.get(name)
        if expected is not None and current.target != expected:
            raise RefConflict(f"ref {name!r} moved: expected {_short(expected)}")
        if changed_at is not None and current.history and current.history[-1].time != changed_at:
            raise RefConflict(f"ref {name!r} was set again since {changed_at}")
        assert current.version is not None
        try:
            self.blobs.delete_conditional(ref_key(current.name), current.version)
        except PreconditionFailed as e:
            raise RefConflict(f"ref {name!r} was changed by another writer; not deleted") from e
        return current


def _short(target: object) -> str:
    return str(target)[:12] if target else "nothing"
