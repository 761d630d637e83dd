"""MemoryBlobStore: a dict-backed store for tests and scratch work, with an injectable clock."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator

from cas.blobstore.base import BlobInfo, BlobStore, BytesLike, Payload, Version, check_key, joined
from cas.errors import NotFound, PreconditionFailed


class MemoryBlobStore(BlobStore):
    """Everything in one process's memory; thread-safe; lost when the process ends."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.url = "memory://"
        self._clock = clock
        self._blobs: dict[str, tuple[bytes, float, Version]] = {}
        self._lock = threading.Lock()
        self._versions = itertools.count(1)

    def _entry(self, key: str) -> tuple[bytes, float, Version]:
        try:
            return self._blobs[check_key(key)]
        except KeyError as e:
            raise NotFound(f"no blob {key!r}") from e

    def _store(self, key: str, data: bytes) -> Version:
        version = Version(str(next(self._versions)))
        self._blobs[key] = (data, self._clock(), version)
        return version

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._entry(key)[0]

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get(key)[start:end]

    def put(self, key: str, data: Payload) -> None:
        blob = bytes(joined(data))
        with self._lock:
            self._store(check_key(key), blob)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        blob = bytes(joined(data))
        with self._lock:
            if check_key(key) in self._blobs:
                return False
            self._store(key, blob)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._blobs.pop(check_key(key), None)

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        with self._lock:
            found = [
                BlobInfo(key, len(data), mtime)
                for key, (data, mtime, _) in self._blobs.items()
                if key.startswith(prefix)
            ]
        yield from found

    def stat(self, key: str) -> BlobInfo:
        with self._lock:
            data, mtime, _ = self._entry(key)
        return BlobInfo(key, len(data), mtime)

    def touch(self, key: str) -> None:
        with self._lock:
            data, _, version = self._entry(key)
            self._blobs[key] = (data, self._clock(), version)

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        with self._lock:
            data, _, version = self._entry(key)
        return data, version

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        with self._lock:
            current = self._blobs.get(check_key(key))
            current_version = current[2] if current else None
            if current_version != expected:
                raise PreconditionFailed(f"{key!r} changed")
            return self._store(key, bytes(data))

    def delete_conditional(self, key: str, expected: Version) -> None:
        with self._lock:
            current = self._blobs.get(check_key(key))
            if current is None or current[2] != expected:
                raise PreconditionFailed(f"{key!r} changed")
            del self._blobs[key]

    @property
    def mtime_resolution(self) -> float:
        """Exact: a blob's mtime is the store's clock at the write."""
        return 0.0

    @property
    def supports_conditional_writes(self) -> bool:
        """True: one process holds the only copy, and one lock guards it."""
        return True
