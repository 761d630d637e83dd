"""RaceBlobStore: a test wrapper that holds writers at a barrier so a race happens every time.

Thread races found by chance prove little: a check-then-write bug passes most runs. This wrapper
parks the first writes under a key prefix at a ``threading.Barrier`` and releases them together,
so writers that read the same version all reach their write with that version in hand. Writes
after the barrier has released its parties pass straight through (a loser's retry must not
wait for partners that will never come). Every other call is passed on untouched.
"""

from __future__ import annotations

import threading

from cas.blobstore.base import BlobStore, BytesLike, Payload, Version
from cas.blobstore.wrapper import BlobStoreWrapper


class RaceBlobStore(BlobStoreWrapper):
    """Passes calls to ``inner``; the first ``barrier.parties`` writes under ``prefix`` meet at
    ``barrier`` before they reach it.

    Every way of writing a key waits: conditional and plain puts and deletes alike, so code that
    bypasses compare-and-swap is held at the same point as code that uses it.
    """

    def __init__(
        self, inner: BlobStore, barrier: threading.Barrier, *, prefix: str, timeout: float = 30.0
    ) -> None:
        super().__init__(inner)
        self.barrier = barrier
        self.prefix = prefix
        self.timeout = timeout
        self.held = 0
        """How many writes waited at the barrier."""
        self._count_lock = threading.Lock()

    def _meet(self, key: str) -> None:
        if not key.startswith(self.prefix):
            return
        with self._count_lock:
            if self.held >= self.barrier.parties:
                return
            self.held += 1
        self.barrier.wait(self.timeout)

    def put(self, key: str, data: Payload) -> None:
        self._meet(key)
        super().put(key, data)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        self._meet(key)
        return super().put_if_absent(key, data)

    def put_transient(self, key: str, data: BytesLike) -> None:
        self._meet(key)
        super().put_transient(key, data)

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        self._meet(key)
        return super().put_conditional(key, data, expected)

    def delete(self, key: str) -> None:
        self._meet(key)
        super().delete(key)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self._meet(key)
        super().delete_conditional(key, expected)
