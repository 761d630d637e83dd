"""ReadOnlyBlobStore: a wrapper that refuses every write with ReadOnlyError."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NoReturn

from cas.blobstore.base import BlobInfo, BlobStore, Version
from cas.errors import ReadOnlyError


class ReadOnlyBlobStore(BlobStore):
    """Passes reads through to ``inner`` and refuses writes."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url

    def _refuse(self, key: str) -> NoReturn:
        raise ReadOnlyError(f"store {self.url} is read-only (writing {key!r})")

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def read_into(self, key: str, start: int, out: memoryview) -> int:
        return self.inner.read_into(key, start, out)

    def read_into_parts(self, key: str, start: int, outs: Sequence[memoryview]) -> int:
        return self.inner.read_into_parts(key, start, outs)

    @property
    def reads_in_place(self) -> bool:
        return self.inner.reads_in_place

    def drop_cached(self, key: str) -> bool:
        return self.inner.drop_cached(key)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._refuse(key)

    def put_new_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        self._refuse(key)

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def delete(self, key: str) -> None:
        self._refuse(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        return self.inner.list_info(prefix)

    def stat(self, key: str) -> BlobInfo:
        return self.inner.stat(key)

    def touch(self, key: str) -> None:
        self._refuse(key)

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        return self.inner.get_versioned(key)

    def put_conditional(
        self, key: str, data: bytes | bytearray | memoryview, expected: Version | None
    ) -> Version:
        self._refuse(key)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self._refuse(key)

    def close(self) -> None:
        self.inner.close()
