"""BlobCopier: an object's way from one store into another, as it is stored where it can be.

Between two stores sealed with the same key (``cas.blobstore.sealed``) an object's stored form
is valid in both: the same name, and a tag over the same plain key. It then travels as it is,
neither decrypted for the trip nor sealed again under a new nonce, so the destination's file
is byte for byte the source's. Its plaintext is still read out of it on the way (the tag is
checked, and the caller checks the digest), so corrupt bytes never travel. Between a plain
store and a sealed one, or two keys, the plaintext travels and the destination seals it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from cas.blobstore.appendonly import AppendOnlyBlobStore
from cas.blobstore.base import BlobStore
from cas.blobstore.wrapper import BlobStoreWrapper

if TYPE_CHECKING:
    from cas.blobstore.sealed import SealedBlobStore


class BlobCopier:
    """``get`` an object from ``source``, then ``put_if_absent`` the same bytes into ``dest``."""

    def __init__(self, source: BlobStore, dest: BlobStore) -> None:
        self.source = source
        self.dest = dest
        reader, writer = _sealed_below(source, reads=True), _sealed_below(dest, reads=False)
        self.as_stored = (
            (reader, writer)
            if reader is not None and writer is not None and reader.same_key(writer)
            else None
        )
        """The sealed layers of both stores, when objects travel as they are stored."""
        self._stored: dict[str, bytes] = {}

    def get(self, key: str) -> bytes:
        """The plaintext of ``key`` in ``source`` (its stored form kept for ``put_if_absent``)."""
        if self.as_stored is None:
            return self.source.get(key)
        reader = self.as_stored[0]
        stored = reader.inner.get(reader.stored_key(key))
        plain = reader.unseal(key, stored)
        self._stored[key] = stored
        return plain

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Store ``data`` (what ``get`` returned for ``key``) in ``dest`` unless it holds
        ``key``; whether this call created it."""
        stored = self._stored.pop(key, None)
        if self.as_stored is None or stored is None:
            return self.dest.put_if_absent(key, data)
        writer = self.as_stored[1]
        return writer.inner.put_if_absent(writer.stored_key(key), stored)


def _sealed_below(store: BlobStore, *, reads: bool) -> SealedBlobStore | None:
    """The sealed store under ``store``'s wrappers that pass reads (or, for writes, puts)
    through unchanged; None when there is none."""
    if "cas.blobstore.sealed" not in sys.modules:
        return None  # it loads with the process's first sealed store (``cas.repo.opening``)
    from cas.blobstore.sealed import SealedBlobStore

    while not isinstance(store, SealedBlobStore):
        if not isinstance(store, BlobStoreWrapper):
            return None
        if not (store.READS_THROUGH if reads else isinstance(store, AppendOnlyBlobStore)):
            return None
        store = store.inner
    return store
