"""Damaged ref records: what their bytes still name, removing them, and setting them aside.

A ref record that cannot be decoded still holds, in most real damage (a truncated write, a flipped
bit, a stray byte), the digests it named: msgpack stores a target as its 64 hex characters.
``salvage_digests`` finds them, so GC can keep what the record still names and ``cas repair``
can rebuild the ref from it. ``remove`` deletes a record whatever it holds (``cas rm``), and
``set_aside`` moves it under ``damaged/`` with its bytes kept (``cas repair``)::

    damaged/refs/<the record's key below refs/>/<stamp>-<nonce>.ref

No key under ``damaged/`` is a ref or an object key, so listings, GC and transfers never see it.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

from cas.blobstore.base import Version
from cas.digest import Digest
from cas.errors import CASError, FormatError, NotFound
from cas.refs.keys import REFS_PREFIX, ref_key
from cas.refs.records import RefRecord, encode_ref
from cas.refs.store import RefStore

DAMAGED_PREFIX = "damaged/"
"""Where ``cas repair`` keeps the bytes of the ref records it moved aside or rewrote."""
_HEX_DIGEST = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


@dataclass(frozen=True)
class RawRecord:
    """A ref record's bytes as stored, and the version a conditional delete must expect."""

    key: str
    data: bytes | None
    """None when even the bytes cannot be read back (an encrypted blob that fails its tag)."""
    version: Version | None


def read_raw(refs: RefStore, key: str) -> RawRecord | None:
    """The bytes stored under a ref key, or None when the key is gone."""
    try:
        data, version = refs.blobs.get_versioned(key)
    except NotFound:
        return None
    except CASError:  # a sealed store's blob that fails its tag: no bytes to salvage or keep
        return RawRecord(key, None, None)
    return RawRecord(key, data, version)


def salvage_digests(data: bytes) -> list[Digest]:
    """The digests ``data`` still spells out, in the order they appear (a record writes its
    target first, then its history oldest first, then its sealed segments), each once."""
    seen: dict[Digest, None] = {}
    for match in _HEX_DIGEST.finditer(data):
        seen.setdefault(Digest(match.group().decode()), None)
    return list(seen)


def remove(refs: RefStore, raw: RawRecord) -> None:
    """Delete the record if it still holds ``raw``'s version (PreconditionFailed otherwise); a
    record whose bytes cannot be read back has no version to check, and is deleted as it is."""
    if raw.version is None:
        refs.blobs.delete(raw.key)
    else:
        refs.blobs.delete_conditional(raw.key, raw.version)
    refs.forget_decoded()


def keep_copy(refs: RefStore, raw: RawRecord, now: float | None = None) -> str:
    """Store a copy of ``raw``'s bytes under ``damaged/``; return its key."""
    if raw.data is None:
        raise FormatError(f"ref blob {raw.key!r} cannot be read back, so it cannot be kept")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    key = f"{DAMAGED_PREFIX}{raw.key}/{stamp}-{uuid.uuid4().hex[:8]}.ref"
    refs.blobs.put(key, raw.data)
    return key


def set_aside(refs: RefStore, raw: RawRecord, now: float | None = None) -> str:
    """Move a record under ``damaged/`` (copy first, then delete on its version); return where.

    A writer that replaced the record meanwhile wins: PreconditionFailed, and the copy stays.
    """
    aside = keep_copy(refs, raw, now)
    remove(refs, raw)
    return aside


def kept_records(refs: RefStore) -> Iterator[str]:
    """The keys of every record copy under ``damaged/``."""
    return refs.blobs.list(DAMAGED_PREFIX + REFS_PREFIX)


def drop_damaged_events(refs: RefStore, record: RefRecord) -> None:
    """Rewrite ``record`` without its unreadable history entries and without a new event, on
    its version (PreconditionFailed when it moved meanwhile). Keep a copy first."""
    kept = replace(record, damaged_events=(), legacy_key=None, version=None)
    # A long name still at an older cas's key: the current key is created and wins every read.
    expected = None if record.legacy_key is not None else record.version
    refs.blobs.put_conditional(ref_key(record.name), encode_ref(kept), expected)
    refs.forget_decoded()
