"""CachingBlobStore: a local blob store in front of a remote one (S3) for immutable blobs.

Only keys under the ``prefixes`` it is given are cached, and only keys whose content can never
change under them (content-addressed objects: cas passes ``chunks/`` and ``manifests/``). Refs,
the store config and everything else always go to the remote, which stays the single source
of truth that other writers see.

- Reads of cached keys try the local store first. A miss reads the remote, hands the blob to
  ``verify`` (which raises unless the blob is what its key names) and only then writes it
  locally, so a corrupt remote blob is never cached.
- Ranged reads always go to the remote. A ranged read of a chunk is a header read (which base a
  stored chunk depends on), and the remote may have stored the chunk again, against another
  base, since this cache filled.
- Writes are write-through: remote first, then the local copy. A save through the cache
  therefore completes only when the remote holds every chunk, and the remote ref (moved after
  the chunks) never names a chunk that exists only in this machine's cache. A failure to fill
  the cache is logged and ignored; it costs a later remote read, not data. A create-only put
  that finds the key on the remote already caches nothing: the remote may hold another
  encoding, and the cache must hold what the remote holds.
- ``has``, ``stat``, ``touch`` and listings ask the remote: dedup must check that the remote
  has a chunk (GC there may have swept it even though the cache still holds it), and GC ages
  are the remote's.

The cache grows without bound; delete its directory (or some of it) whenever you like.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from cas.blobstore.base import BlobStore, Payload
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import BackendError, NotFound

log = logging.getLogger(__name__)

Verifier = Callable[[BlobStore, str, bytes], None]
"""``verify(store, key, blob)`` raises (``IntegrityError``) unless ``blob`` is what ``key`` names.
``store`` is the cache itself, for whatever decoding the blob needs to read (delta bases)."""


class CachingBlobStore(BlobStoreWrapper):
    """``remote`` (the wrapped store) fronted by ``local`` for keys under ``prefixes``."""

    def __init__(
        self, local: BlobStore, remote: BlobStore, *, prefixes: tuple[str, ...], verify: Verifier
    ) -> None:
        super().__init__(remote)
        self.local = local
        self.remote = remote
        self.prefixes = prefixes
        self._verify = verify

    def rewrapped(self, wrap: Callable[[BlobStore], BlobStore]) -> CachingBlobStore:
        """The same cache with ``wrap`` applied to its local and its remote store alike (each
        sealed under a store's key: ``cas.blobstore.sealed.sealed_store``)."""
        return CachingBlobStore(
            wrap(self.local), wrap(self.remote), prefixes=self.prefixes, verify=self._verify
        )

    def cacheable(self, key: str) -> bool:
        """Whether ``key`` names an immutable blob this cache holds copies of."""
        return key.startswith(self.prefixes)

    def cached(self, key: str) -> bool:
        """Whether ``key`` is held locally (no remote request)."""
        return self.cacheable(key) and self.local.has(key)

    def get(self, key: str) -> bytes:
        if not self.cacheable(key):
            return self.remote.get(key)
        try:
            return self.local.get(key)
        except NotFound:
            pass
        blob = self.remote.get(key)
        self._verify(self, key, blob)
        self._fill(key, blob)
        return blob

    def put(self, key: str, data: Payload) -> None:
        self.remote.put(key, data)
        self._fill(key, data)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        created = self.remote.put_if_absent(key, data)
        if created:
            self._fill(key, data)
        return created

    def _fill(self, key: str, data: Payload) -> None:
        if not self.cacheable(key):
            return
        try:
            self.local.put(key, data)
        except BackendError as e:
            log.warning("cas cache: cannot cache %s in %s: %s", key, self.local.url, e)

    def delete(self, key: str) -> None:
        self.remote.delete(key)
        if self.cacheable(key):
            self.local.delete(key)

    def drop_cached(self, key: str) -> bool:
        if not self.cached(key):
            return False
        self.local.delete(key)
        return True

    def sync(self) -> None:
        self.remote.sync()
        self.local.sync()

    def close(self) -> None:
        self.remote.close()
        self.local.close()

    @property
    def local_root(self) -> Path | None:
        """None: a cached copy may be missing or stale, so reads go through ``get``."""
        return None

    @property
    def supports_rename(self) -> bool:
        return False


class LocalFirstBlobStore(BlobStoreWrapper):
    """``remote`` (the wrapped store) for reading, with keys under ``prefixes`` tried in ``local``
    first and nothing written to either: a checkpoint loaded from a remote store this way takes
    the objects this machine holds already from here (a cached base model does not travel).

    Only for immutable, content-addressed keys, and only reads: whatever the caller loads is
    verified against its digests on the way, whichever side it came from.
    """

    def __init__(
        self,
        local: BlobStore,
        remote: BlobStore,
        *,
        prefixes: tuple[str, ...],
        remembered: tuple[str, ...] = (),
        keep: KeptObjects | None = None,
    ) -> None:
        super().__init__(remote)
        self.local = local
        self.prefixes = prefixes
        self.remembered = remembered
        """Keys read from ``remote`` more than once by one load (a manifest: for its checks,
        then for its chunks), kept after the first read: small, and immutable."""
        self.keep = keep
        """Where the objects under ``prefixes`` read from ``remote`` are also kept, for a later
        copy of them into ``local`` (``HandedBlobStore``), if anywhere."""
        self._remembered_objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        if key.startswith(self.prefixes):
            try:
                return self.local.get(key)
            except NotFound:
                pass
        if not key.startswith(self.remembered):
            data = self.inner.get(key)
        else:
            with self._lock:
                remembered = self._remembered_objects.get(key)
            if remembered is not None:
                return remembered
            data = self.inner.get(key)
            with self._lock:
                self._remembered_objects[key] = data
        if self.keep is not None and key.startswith(self.prefixes):
            self.keep.add(key, data)
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if key.startswith(self.prefixes) and end > start:
            try:
                return self.local.get_range(key, start, end)
            except NotFound:
                pass
        return self.inner.get_range(key, start, end)

    def close(self) -> None:
        """Nothing: both stores belong to the repositories that opened them."""

    @property
    def local_root(self) -> Path | None:
        """None: reads go through ``get``, which picks the side."""
        return None

    @property
    def supports_rename(self) -> bool:
        return False


class KeptObjects:
    """Objects read from a remote store, kept in memory up to ``limit`` bytes for one later copy
    of the same objects, so they cross the network once (``HandedBlobStore`` hands them out).

    A resume loads a checkpoint straight from the remote tier, then the run's next save pulls
    it into the local one: without these, every object the load read was read again.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._objects: dict[str, bytes] = {}
        self.nbytes = 0
        self._lock = threading.Lock()

    def add(self, key: str, data: bytes) -> None:
        """Keep ``data`` (the object ``key`` as its store holds it) if it fits under the limit."""
        with self._lock:
            if key not in self._objects and self.nbytes + len(data) <= self.limit:
                self._objects[key] = data
                self.nbytes += len(data)

    def take(self, key: str) -> bytes | None:
        """The object ``key`` if kept, forgotten here; None if not."""
        with self._lock:
            data = self._objects.pop(key, None)
            if data is not None:
                self.nbytes -= len(data)
            return data

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)


class HandedBlobStore(BlobStoreWrapper):
    """``inner``, with the objects in ``kept`` read from memory instead, each once: a copy out
    of ``inner`` that follows a read of the same objects (``KeptObjects``). What is read is
    checked by the caller against its digests, as any read of ``inner`` is."""

    def __init__(self, inner: BlobStore, kept: KeptObjects) -> None:
        super().__init__(inner)
        self.kept = kept

    def get(self, key: str) -> bytes:
        data = self.kept.take(key)
        return self.inner.get(key) if data is None else data

    def close(self) -> None:
        """Nothing: ``inner`` belongs to the repository that opened it."""

    @property
    def supports_rename(self) -> bool:
        return False
