"""RetryingBlobStore: a wrapper that retries transient backend failures with backoff and jitter.

Only ``TransientBackendError`` is retried. ``NotFound``, ``PreconditionFailed`` and every other
``CASError`` are answers, not failures, and pass straight through.

Conditional writes need care: when an attempt fails transiently the write may still have happened
on the server, and the retry then loses against our own write. So once an attempt of
``put_conditional`` has failed transiently, a later ``PreconditionFailed`` is checked: if the
blob's current bytes equal ``data``, the earlier attempt landed and its version is returned.
That reasoning is sound only if no other writer could store the very same bytes, so payloads
written by several writers (refs) carry something unique to the writer, such as its id and a
timestamp. ``delete_conditional`` likewise treats "already gone" after a transient failure as
success. The check depends on seeing that transient failure, so below this wrapper nothing
may retry on its own: an S3 client makes each request once (``cas.blobstore.s3.client``).

``put_if_absent`` (create-only chunk writes) has the same ambiguity: a retry after an attempt that
did land finds the key taken and the inner store answers False. So after a transient failure a
False is checked the same way: if the blob holds exactly the bytes we sent, True is returned. The
True may then come from another writer that stored the very same bytes first, which for a chunk
(the same encoding of the same content, hence the same base) is the same outcome.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from cas.blobstore.base import BlobInfo, BlobStore, BytesLike, Payload, Version, joined
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import NotFound, PreconditionFailed, TransientBackendError

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry; delays are capped exponential with full jitter."""

    attempts: int = 5
    """Total attempts, including the first."""
    base_delay: float = 0.1
    max_delay: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy delays must not be negative")

    def delay(self, failures: int, rng: random.Random) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        cap = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return rng.uniform(0.0, cap)


class RetryingBlobStore(BlobStoreWrapper):
    """Passes every call to ``inner``, retrying ``TransientBackendError`` per ``policy``.

    Every operation is overridden (each may fail transiently); capabilities are forwarded.
    """

    def __init__(
        self,
        inner: BlobStore,
        policy: RetryPolicy | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.Random()

    def _call(self, operation: Callable[[], T]) -> T:
        failures = 0
        while True:
            try:
                return operation()
            except TransientBackendError:
                failures += 1
                if failures >= self.policy.attempts:
                    raise
                self._sleep(self.policy.delay(failures, self._rng))

    def get(self, key: str) -> bytes:
        return self._call(lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call(lambda: self.inner.get_range(key, start, end))

    def put(self, key: str, data: Payload) -> None:
        self._call(lambda: self.inner.put(key, data))

    def put_transient(self, key: str, data: BytesLike) -> None:
        self._call(lambda: self.inner.put_transient(key, data))

    def put_if_absent(self, key: str, data: Payload) -> bool:
        """Retry the create-only put; see the module docstring for the ambiguous-failure rule."""
        failed_transiently = False

        def attempt() -> bool:
            nonlocal failed_transiently
            try:
                created = self.inner.put_if_absent(key, data)
            except TransientBackendError:
                failed_transiently = True
                raise
            if created or not failed_transiently:
                return created
            return self._version_if_holding(key, joined(data)) is not None

        return self._call(attempt)

    def has(self, key: str) -> bool:
        return self._call(lambda: self.inner.has(key))

    def delete(self, key: str) -> None:
        self._call(lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        """All keys under ``prefix``; a failed listing restarts, so the keys are collected first."""
        return iter(self._call(lambda: list(self.inner.list(prefix))))

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Like ``list``: collected in full so that a retry cannot yield a key twice."""
        return iter(self._call(lambda: list(self.inner.list_info(prefix))))

    def stat(self, key: str) -> BlobInfo:
        return self._call(lambda: self.inner.stat(key))

    def touch(self, key: str) -> None:
        self._call(lambda: self.inner.touch(key))

    def sync(self) -> None:
        self._call(self.inner.sync)

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        return self._call(lambda: self.inner.get_versioned(key))

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        """Retry the compare-and-swap; see the module docstring for the ambiguous-failure rule."""
        failed_transiently = False

        def attempt() -> Version:
            nonlocal failed_transiently
            try:
                return self.inner.put_conditional(key, data, expected)
            except TransientBackendError:
                failed_transiently = True
                raise
            except PreconditionFailed:
                landed = self._version_if_holding(key, data) if failed_transiently else None
                if landed is None:
                    raise
                return landed

        return self._call(attempt)

    def _version_if_holding(self, key: str, data: BytesLike) -> Version | None:
        """The blob's version if it holds exactly ``data``, else None."""
        try:
            current, version = self.inner.get_versioned(key)
        except NotFound:
            return None
        return version if current == bytes(data) else None

    def delete_conditional(self, key: str, expected: Version) -> None:
        """Retry the conditional delete; gone after a transient failure counts as deleted."""
        failed_transiently = False

        def attempt() -> None:
            nonlocal failed_transiently
            try:
                self.inner.delete_conditional(key, expected)
            except TransientBackendError:
                failed_transiently = True
                raise
            except PreconditionFailed:
                if not failed_transiently or self.inner.has(key):
                    raise

        self._call(attempt)
