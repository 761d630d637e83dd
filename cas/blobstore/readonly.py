"""ReadOnlyBlobStore: a wrapper that refuses every write with ReadOnlyError."""

from __future__ import annotations

from typing import NoReturn

from cas.blobstore.base import BytesLike, Payload, Version
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import ReadOnlyError


class ReadOnlyBlobStore(BlobStoreWrapper):
    """Passes reads through to ``inner`` (in place, where it reads files) and refuses writes.

    Every method in ``cas.blobstore.wrapper.WRITE_METHODS`` is overridden here; GC may not rename
    the files beneath it either (``supports_rename`` is False).
    """

    READS_THROUGH = True

    def _refuse(self, key: str) -> NoReturn:
        raise ReadOnlyError(f"store {self.url} is read-only (writing {key!r})")

    def put(self, key: str, data: Payload) -> None:
        self._refuse(key)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        self._refuse(key)

    def put_transient(self, key: str, data: BytesLike) -> None:
        self._refuse(key)

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        self._refuse(key)

    def touch(self, key: str) -> None:
        self._refuse(key)

    def delete(self, key: str) -> None:
        self._refuse(key)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self._refuse(key)

    @property
    def supports_rename(self) -> bool:
        return False
