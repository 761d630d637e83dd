"""RecordingBlobStore: a test wrapper that writes down, in order, every call that changes a store.

Invariant 1 (blobs, then manifest, then ref) is about order, and order is invisible in the state
a save leaves: a save that moves its ref before its manifest is durable looks the same afterwards
as one that does not, until a crash lands in between. This wrapper keeps the sequence of writes
(``put``, ``put_if_absent``, ``put_transient``, ``put_conditional``, ``touch``, the deletes) and
of ``sync`` calls, so a test can assert the order itself (``tests/test_write_order.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cas.blobstore.base import BlobStore, BytesLike, Payload, Version
from cas.blobstore.wrapper import BlobStoreWrapper


@dataclass(frozen=True)
class Call:
    """One recorded call: ``op`` is the method's name, ``key`` empty for ``sync``."""

    op: str
    key: str = ""


class RecordingBlobStore(BlobStoreWrapper):
    """Passes every call to ``inner`` and appends each write and sync to ``calls`` once it
    returned (a write that raised is not recorded: it did not happen)."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def _record(self, op: str, key: str = "") -> None:
        with self._lock:
            self.calls.append(Call(op, key))

    def put(self, key: str, data: Payload) -> None:
        self.inner.put(key, data)
        self._record("put", key)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        created = self.inner.put_if_absent(key, data)
        self._record("put_if_absent" if created else "found", key)
        return created

    def put_transient(self, key: str, data: BytesLike) -> None:
        self.inner.put_transient(key, data)
        self._record("put_transient", key)

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        version = self.inner.put_conditional(key, data, expected)
        self._record("put_conditional", key)
        return version

    def touch(self, key: str) -> None:
        self.inner.touch(key)
        self._record("touch", key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        self._record("delete", key)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self.inner.delete_conditional(key, expected)
        self._record("delete_conditional", key)

    def sync(self) -> None:
        self.inner.sync()
        self._record("sync")

    def history(self) -> list[Call]:
        """A copy of the calls recorded so far, in order."""
        with self._lock:
            return list(self.calls)
