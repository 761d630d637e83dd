"""BlobStoreWrapper: the base of every wrapper, forwarding each method and capability to ``inner``.

A wrapper (retry, cache, read-only, fault injection) overrides only what its concern changes and
inherits the rest, so a capability added to ``BlobStore`` reaches through every wrapper at once.
The read-only wrapper is the exception that proves the rule: it overrides every method in
``WRITE_METHODS``, and the conformance suite calls each of them on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from cas.blobstore.base import BlobInfo, BlobStore, BytesLike, Payload, Version

WRITE_METHODS = (
    "put",
    "put_if_absent",
    "put_transient",
    "put_conditional",
    "touch",
    "delete",
    "delete_conditional",
)
"""Every ``BlobStore`` method that changes what is stored."""


class BlobStoreWrapper(BlobStore):
    """Passes every call to ``inner``; subclasses override the calls they change.

    ``for_background_writes`` is not forwarded: the wrapper itself (the default) is the handle a
    background writer gets, so its writes keep going through the wrapper.
    """

    READS_THROUGH = False
    """Whether reads reach ``inner`` unchanged (read-only and append-only handles): then
    ``inner``'s own way of reading into a caller's buffers (a sealed store decrypting a local
    file into them) is this wrapper's too. A wrapper that changes or watches reads (a cache,
    fault injection, a recorder) reads through its own ``get`` and ``get_range``."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def stat(self, key: str) -> BlobInfo:
        return self.inner.stat(key)

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        return self.inner.list_info(prefix)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def put(self, key: str, data: Payload) -> None:
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        return self.inner.put_if_absent(key, data)

    def put_transient(self, key: str, data: BytesLike) -> None:
        self.inner.put_transient(key, data)

    def touch(self, key: str) -> None:
        self.inner.touch(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        return self.inner.get_versioned(key)

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        return self.inner.put_conditional(key, data, expected)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self.inner.delete_conditional(key, expected)

    def sync(self) -> None:
        self.inner.sync()

    def drop_cached(self, key: str) -> bool:
        return self.inner.drop_cached(key)

    def close(self) -> None:
        self.inner.close()

    @property
    def accepts_deletes(self) -> bool:
        return self.inner.accepts_deletes

    @property
    def supports_conditional_writes(self) -> bool:
        return self.inner.supports_conditional_writes

    @property
    def mtime_resolution(self) -> float:
        return self.inner.mtime_resolution

    @property
    def local_root(self) -> Path | None:
        return self.inner.local_root

    @property
    def reads_in_place(self) -> bool:
        if self.READS_THROUGH:
            return self.inner.reads_in_place
        return self.local_root is not None

    def read_into_buffers(self, key: str, start: int, outs: Sequence[memoryview]) -> int | None:
        return self.inner.read_into_buffers(key, start, outs) if self.READS_THROUGH else None

    @property
    def supports_rename(self) -> bool:
        return self.inner.supports_rename
