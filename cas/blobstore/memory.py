"""MemoryBlobStore: a dict-backed store for tests and scratch work, with an injectable clock."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from cas.blobstore.base import BlobInfo, BlobStore, Version, check_key
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

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        with self._lock:
            self._store(check_key(key), bytes(data))

    def put_new_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        data = b"".join(parts)
        with self._lock:
            if check_key(key) in self._blobs:
                return False
            self._store(key, data)
        return True

    def has(self, key: str) -> bool:
        with self._lock:
            return check_key(key) in self._blobs

    def delete(self, key: str) -> None:
        with self._lock:
            self._blobs.pop(check_key(key), None)

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._blobs if k.startswith(prefix)]
        yield from keys

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

    def put_conditional(
        self, key: str, data: bytes | bytearray | memoryview, expected: Version | None
    ) -> Version:
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
