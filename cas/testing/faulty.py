"""FaultyBlobStore: a test wrapper that makes calls fail on purpose.

Faults come from three sources: a per-method probability drawn from a seeded ``random.Random``
(so a failing run replays exactly), faults queued with ``fail_next`` for a test that needs
one particular call to fail, and ``fail_call(n)``, which fails the n-th call from now whatever
its method, so a test can strike every point of an operation in turn. A write fault may strike
*after* the write happened, which is the case a retry layer must not mistake for a conflict.
A fault raises ``TransientBackendError`` unless ``error`` builds another exception (a
``BackendError`` saying EIO, say, which no retry layer retries). Every call and fault is counted.
"""

from __future__ import annotations

import random
import threading
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TypeVar

from cas.blobstore.base import BlobInfo, BlobStore, BytesLike, Payload, Version
from cas.blobstore.wrapper import WRITE_METHODS, BlobStoreWrapper
from cas.errors import TransientBackendError

T = TypeVar("T")


class FaultyBlobStore(BlobStoreWrapper):
    """Passes calls to ``inner``, failing some of them with ``TransientBackendError``.

    ``rate`` is the fault probability for every method, overridden per method by ``rates``
    (keys are method names: "get", "put_conditional", ...). ``after_write`` is the share of
    write faults raised after the write reached ``inner``.
    """

    def __init__(
        self,
        inner: BlobStore,
        *,
        rate: float = 0.0,
        rates: Mapping[str, float] | None = None,
        after_write: float = 0.0,
        seed: int = 0,
        error: Callable[[str], Exception] = TransientBackendError,
    ) -> None:
        super().__init__(inner)
        self.error = error
        self.rate = rate
        self.rates = dict(rates or {})
        self.after_write = after_write
        self.calls: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._queued: dict[str, deque[bool]] = {}
        self._countdown: tuple[int, frozenset[str] | None] | None = None

    def fail_next(self, method: str, count: int = 1, *, after_write: bool = False) -> None:
        """Make the next ``count`` calls of ``method`` fail (after doing it, for writes)."""
        with self._lock:
            self._queued.setdefault(method, deque()).extend([after_write] * count)

    def fail_call(self, index: int, methods: Collection[str] | None = None) -> None:
        """Make the call ``index`` calls from now (0: the next one) fail before it runs,
        counting only calls of ``methods`` when given."""
        with self._lock:
            self._countdown = (index, frozenset(methods) if methods is not None else None)

    def _decide(self, method: str) -> tuple[bool, bool]:
        """Whether this call fails, and if so whether after doing the work."""
        with self._lock:
            self.calls[method] += 1
            queue = self._queued.get(method)
            struck = False
            if self._countdown is not None:
                left, methods = self._countdown
                if methods is None or method in methods:
                    struck = left == 0
                    self._countdown = None if struck else (left - 1, methods)
            if struck:
                fail, after = True, False
            elif queue:
                fail, after = True, queue.popleft()
            else:
                fail = self._rng.random() < self.rates.get(method, self.rate)
                after = fail and method in WRITE_METHODS and self._rng.random() < self.after_write
            if fail:
                self.faults[method] += 1
            return fail, after

    def _run(self, method: str, operation: Callable[[], T]) -> T:
        fail, after = self._decide(method)
        if fail and not after:
            raise self.error(f"injected fault before {method} on {self.url}")
        result = operation()
        if fail:
            raise self.error(f"injected fault after {method} on {self.url}")
        return result

    def get(self, key: str) -> bytes:
        return self._run("get", lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._run("get_range", lambda: self.inner.get_range(key, start, end))

    def put(self, key: str, data: Payload) -> None:
        self._run("put", lambda: self.inner.put(key, data))

    def put_transient(self, key: str, data: BytesLike) -> None:
        self._run("put_transient", lambda: self.inner.put_transient(key, data))

    def put_if_absent(self, key: str, data: Payload) -> bool:
        return self._run("put_if_absent", lambda: self.inner.put_if_absent(key, data))

    def has(self, key: str) -> bool:
        return self._run("has", lambda: self.inner.has(key))

    def delete(self, key: str) -> None:
        self._run("delete", lambda: self.inner.delete(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(self._run("list", lambda: list(self.inner.list(prefix))))

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        return iter(self._run("list_info", lambda: list(self.inner.list_info(prefix))))

    def stat(self, key: str) -> BlobInfo:
        return self._run("stat", lambda: self.inner.stat(key))

    def touch(self, key: str) -> None:
        self._run("touch", lambda: self.inner.touch(key))

    def sync(self) -> None:
        self._run("sync", self.inner.sync)

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        return self._run("get_versioned", lambda: self.inner.get_versioned(key))

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        return self._run("put_conditional", lambda: self.inner.put_conditional(key, data, expected))

    def delete_conditional(self, key: str, expected: Version) -> None:
        self._run("delete_conditional", lambda: self.inner.delete_conditional(key, expected))
