"""Fence records: the index that keeps them out of listings, and when one may go.

GC fences the ref an expired writer declared; where no ref exists it writes a *fence record* at
the ref's key (``cas.refs.records``), so that the writer's create-only write fails if it ever
resumes. A fence record reads as "no such ref", but a listing of keys cannot tell it from a ref
without reading it, so GC indexes each one under ``state/fenced-refs/`` before writing it: a
listing of names reads only the indexed keys, usually none. A fence record matters only while a
writer it names could still write. It goes when each of them has withdrawn (a writer that finds
its lease lost withdraws from the fences of the refs it declared when it releases the lease), is
certainly dead (same host, boot and PID namespace, and its process is gone: ``cas.refs.liveness``),
or after ``FENCE_KEEP``, which no writer
is assumed to stay frozen between its last lease check and its ref write (docs/gc.md, "Safety").
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass

from cas.blobstore.base import BlobStore
from cas.errors import CASError, NotFound, PreconditionFailed
from cas.names import RefName
from cas.refs.keys import REFS_PREFIX, ref_key
from cas.refs.records import FencedRef, encode_fence, read_fence

FENCE_INDEX = "state/fenced-refs/"
"""One empty blob per fence record, named like the ref's key: what ``RefStore.names`` must read."""
FENCE_KEEP = 7 * 86400.0
"""A fence record whose writers' fate is unknown (they ran elsewhere) goes after this long."""


def index_key(key: str) -> str:
    """The index entry of the fence record stored under ref blob ``key``."""
    return FENCE_INDEX + key[len(REFS_PREFIX) :]


def indexed_keys(blobs: BlobStore, prefix: str) -> set[str]:
    """The ref blob keys under ``prefix`` that the index says may hold a fence record."""
    start = FENCE_INDEX + prefix[len(REFS_PREFIX) :]
    return {REFS_PREFIX + key[len(FENCE_INDEX) :] for key in blobs.list(start)}


@dataclass(frozen=True)
class FenceEntry:
    """An index entry and the fence record behind it (None: none any more, a stale entry)."""

    key: str
    fence: FencedRef | None

    def removable(self, now: float) -> bool:
        """Whether no writer it fences can write again: all withdrew or are known dead, or it
        is older than ``FENCE_KEEP``; a stale index entry always is."""
        if self.fence is None:
            return True
        if now - self.fence.at >= FENCE_KEEP:
            return True
        return all(w.identity().gone() for w in self.fence.writers)


def read_fences(blobs: BlobStore) -> list[FenceEntry]:
    """Every indexed fence record (GC's view), with the stale index entries."""
    entries = []
    for key in sorted(indexed_keys(blobs, REFS_PREFIX)):
        try:
            data, version = blobs.get_versioned(key)
        except NotFound:
            entries.append(FenceEntry(key, None))
            continue
        entries.append(FenceEntry(key, read_fence(data, version)))
    return entries


def remove(blobs: BlobStore, entry: FenceEntry) -> bool:
    """Delete a removable fence record unless it changed since it was read, then its index
    entry; whether the record went. Run by GC under the maintenance lock, the only writer of
    fences, so no new fence appears between the two deletes."""
    if entry.fence is not None and entry.fence.version is not None:
        try:
            blobs.delete_conditional(entry.key, entry.fence.version)
        except (PreconditionFailed, NotFound):
            return False  # a writer created the ref, or another writer withdrew: look next run
    blobs.delete(index_key(entry.key))
    return entry.fence is not None


def withdraw(blobs: BlobStore, name: RefName, writer: str) -> None:
    """Remove ``writer`` from the fence record at ``name``, deleting it when it fenced no one
    else; best effort (GC removes what is left once it may). The index entry stays for GC: a
    fence it writes meanwhile must not lose its entry."""
    key = ref_key(name)
    with contextlib.suppress(CASError):
        data, version = blobs.get_versioned(key)
        fence = read_fence(data, version)
        if fence is None or version is None or all(w.writer != writer for w in fence.writers):
            return
        rest = tuple(w for w in fence.writers if w.writer != writer)
        if rest:
            blobs.put_conditional(
                key, encode_fence(name, uuid.uuid4().hex, rest, fence.at), version
            )
        else:
            blobs.delete_conditional(key, version)
