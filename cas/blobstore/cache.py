"""CachingBlobStore: a local blob store in front of a remote one (S3) for content-addressed objects.

Only ``chunks/`` and ``manifests/`` are cached: their keys are digests of their content, so a
cached copy can never be stale. Refs, the store config and everything else always go to the
remote, which stays the single source of truth that other writers see.

- Reads of cached keys try the local store first. A miss reads the remote, decodes and hashes the
  object (``cas.sync.transfer.verify_object``) and only then writes it locally, so a corrupt remote
  blob is never cached (the object layer verifies every read again on its way out).
- Writes are write-through: remote first, then the local copy. A save through the cache therefore
  completes only when the remote holds every chunk, and the remote ref (moved after the chunks)
  never names a chunk that exists only in this machine's cache. A failure to fill the cache is
  logged and ignored; it costs a later remote read, not data. A create-only put (``put_new_parts``)
  that finds the chunk on the remote already caches nothing: the remote may hold another encoding
  (a delta against another base), and the cache must hold what the remote holds.
- ``has``, ``stat``, ``touch`` and listings ask the remote: dedup must check that the remote has a
  chunk (GC there may have swept it even though the cache still holds it), and GC ages are the
  remote's.

The cache grows without bound; delete its directory (or some of it) whenever you like.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from cas.blobstore.base import BlobInfo, BlobStore, Version
from cas.digest import Digest, parse_digest
from cas.errors import BackendError, FormatError, NotFound
from cas.objects.store import ObjectStore
from cas.sync.transfer import verify_object

log = logging.getLogger(__name__)

CACHED_PREFIXES = ("chunks/", "manifests/")


class CachingBlobStore(BlobStore):
    """``remote`` fronted by ``local`` for immutable, content-addressed keys."""

    def __init__(
        self, local: BlobStore, remote: BlobStore, *, max_object_size: int = (64 << 20) + 4096
    ) -> None:
        self.local = local
        self.remote = remote
        self.url = remote.url
        # Decoding delta chunks needs their bases, which come through this cache as well.
        self._objects = ObjectStore(self, max_object_size=max_object_size)

    @staticmethod
    def _digest_of_key(key: str) -> Digest | None:
        if not key.startswith(CACHED_PREFIXES):
            return None
        try:
            return parse_digest(key.rpartition("/")[2])
        except FormatError:
            return None

    def get(self, key: str) -> bytes:
        digest = self._digest_of_key(key)
        if digest is None:
            return self.remote.get(key)
        try:
            return self.local.get(key)
        except NotFound:
            pass
        blob = self.remote.get(key)
        what = "chunk" if key.startswith("chunks/") else "manifest"
        verify_object(self._objects, digest, blob, what=what)
        self._fill(key, blob)
        return blob

    def _fill(self, key: str, blob: bytes | bytearray | memoryview) -> None:
        try:
            self.local.put(key, blob)
        except BackendError as e:
            log.warning("cas cache: cannot cache %s in %s: %s", key, self.local.url, e)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # Ranges of chunks are header reads: which base the stored chunk depends on. The remote
        # decides that, and its copy may have been swept and stored again against another base
        # since this cache filled, so chunk headers always come from the remote.
        if self._digest_of_key(key) is not None and not key.startswith("chunks/"):
            try:
                return self.local.get_range(key, start, end)
            except NotFound:
                pass
        return self.remote.get_range(key, start, end)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self.remote.put(key, data)
        if self._digest_of_key(key) is not None:
            self._fill(key, data)

    def put_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        self.remote.put_parts(key, parts)
        self._fill_parts(key, parts)

    def put_new_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        created = self.remote.put_new_parts(key, parts)
        if created:
            self._fill_parts(key, parts)
        return created

    def _fill_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        if self._digest_of_key(key) is None:
            return
        try:
            self.local.put_parts(key, parts)
        except BackendError as e:
            log.warning("cas cache: cannot cache %s in %s: %s", key, self.local.url, e)

    def has(self, key: str) -> bool:
        return self.remote.has(key)

    def delete(self, key: str) -> None:
        self.remote.delete(key)
        if self._digest_of_key(key) is not None:
            self.local.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.remote.list(prefix)

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        return self.remote.list_info(prefix)

    def stat(self, key: str) -> BlobInfo:
        return self.remote.stat(key)

    def touch(self, key: str) -> None:
        self.remote.touch(key)

    def sync(self) -> None:
        self.remote.sync()
        self.local.sync()

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        return self.remote.get_versioned(key)

    def put_conditional(
        self, key: str, data: bytes | bytearray | memoryview, expected: Version | None
    ) -> Version:
        return self.remote.put_conditional(key, data, expected)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self.remote.delete_conditional(key, expected)

    def has_many(self, keys: Iterable[str], workers: int = 16) -> dict[str, bool]:
        return self.remote.has_many(keys, workers)

    @property
    def supports_conditional_writes(self) -> bool:
        return self.remote.supports_conditional_writes

    def drop_cached(self, key: str) -> bool:
        if not self.cached(key):
            return False
        self.local.delete(key)
        return True

    def cached(self, key: str) -> bool:
        """Whether ``key`` is held locally (no remote request)."""
        return self._digest_of_key(key) is not None and self.local.has(key)

    def close(self) -> None:
        self.remote.close()
        self.local.close()
