"""The BlobStore contract: a flat namespace of immutable-ish byte blobs under '/'-separated keys."""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NewType

from cas.errors import InvalidName, NotFound

Version = NewType("Version", str)
"""An opaque token naming one stored version of a blob (an ETag on S3, a content hash locally)."""

_KEY_SEGMENT_RE = re.compile(r"[A-Za-z0-9._%@+=,~-]+\Z")

# The default ``put_new_parts`` holds one of these (by key) across its check and its write, so two
# threads of one process never both create a key; striped so unrelated keys rarely wait.
_CREATE_LOCKS = tuple(threading.Lock() for _ in range(256))


@dataclass(frozen=True)
class BlobInfo:
    """What ``stat`` and ``list_info`` report about one blob."""

    key: str
    size: int
    mtime: float
    """Seconds since the epoch of the last write or ``touch``."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidName."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise InvalidName(f"invalid blob key {key!r}")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or not _KEY_SEGMENT_RE.match(segment):
            raise InvalidName(f"invalid blob key {key!r}")
    return key


class BlobStore(ABC):
    """A flat key -> bytes store; the only thing cas needs from a storage backend.

    Contract every backend meets (``cas.testing.BlobStoreConformance`` checks it):

    - ``put`` is atomic: a reader sees the old blob, no blob, or the whole new one, never a prefix.
      A crash during ``put`` leaves no partial blob under ``key``.
    - Read-after-write: once ``put`` returns, ``get``/``has``/``stat``/``list`` see the blob.
    - Durability: blobs written with ``put`` survive a power loss once ``sync()`` has returned;
      ``put_conditional`` and ``delete_conditional`` are durable when they return.
    - A missing key raises ``cas.errors.NotFound`` from ``get``, ``get_range``, ``stat``;
      ``delete`` of a missing key is not an error.
    - Keys are '/'-separated relative paths (see ``check_key``); ``list(prefix)`` yields every key
      that starts with ``prefix`` as a plain string prefix, in no particular order.
    - Conditional writes are compare-and-swap on a ``Version``: ``put_conditional(key, data, None)``
      creates only if absent, otherwise only if the current version equals ``expected``; a loser
      gets ``cas.errors.PreconditionFailed`` and nothing changes.
    - ``put_new_parts`` is create-only: of several writers of one key, one gets True and its bytes
      stay; the others get False and write nothing. Like compare-and-swap, this holds across
      processes and hosts where ``supports_conditional_writes`` is true, else within one process.
    - Backend failures are translated to ``cas.errors.BackendError`` (``TransientBackendError`` when
      a retry may succeed) with ``raise ... from``.
    """

    url: str = ""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole blob."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the blob (clamped to its size)."""

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key`` atomically, replacing any previous blob."""

    def put_transient(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` like ``put``, visible to every reader at once, but with no promise that
        it survives a crash of this machine.

        For blobs whose meaning dies with the writer, a writer lease above all: after a crash no
        writer holds it. Stores where durability costs nothing extra keep the default, ``put``.
        """
        self.put(key, data)

    @abstractmethod
    def has(self, key: str) -> bool:
        """Whether a blob exists under ``key``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the blob if present."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key starting with ``prefix``."""

    @abstractmethod
    def stat(self, key: str) -> BlobInfo:
        """Size and modification time of one blob."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        """Return the blob and the version token to pass to ``put_conditional``."""

    @abstractmethod
    def put_conditional(
        self, key: str, data: bytes | bytearray | memoryview, expected: Version | None
    ) -> Version:
        """Compare-and-swap write; ``expected=None`` means the key must not exist yet."""

    @abstractmethod
    def delete_conditional(self, key: str, expected: Version) -> None:
        """Delete only if the current version is ``expected``."""

    def touch(self, key: str) -> None:
        """Refresh the blob's modification time so age-based GC treats it as new.

        The default rewrites the blob; backends override it with something cheaper.
        """
        self.put(key, self.get(key))

    def put_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """``put`` of the concatenation of ``parts``; backends may avoid the copy."""
        self.put(key, b"".join(parts))

    def put_new_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        """Store the concatenation of ``parts`` only if ``key`` does not exist yet.

        Return True if this call created the blob, False if a blob was there already (it is left
        as it was). Chunks are written this way: the same chunk may be encoded differently (as a
        delta against another base) by two writers, and the loser must learn which encoding is
        stored rather than replace one that a committed manifest may already depend on.

        This default checks ``has`` and then writes with ``put_parts``, holding a per-key lock, so
        it is atomic between threads of one process only: two processes or hosts can both find
        the key absent and both write, and the last write wins. Backends that can create
        atomically override it.
        """
        with _CREATE_LOCKS[hash(key) % len(_CREATE_LOCKS)]:
            if self.has(key):
                return False
            self.put_parts(key, parts)
            return True

    def read_into(self, key: str, start: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes from ``start`` into ``out``; return the count read.

        The default fetches a range; backends with files override it to avoid a copy.
        """
        data = self.get_range(key, start, start + len(out))
        out[: len(data)] = data
        return len(data)

    def read_into_parts(self, key: str, start: int, outs: Sequence[memoryview]) -> int:
        """``read_into`` over several buffers filled in order; return the total count read."""
        total = 0
        for out in outs:
            got = self.read_into(key, start + total, out)
            total += got
            if got < len(out):
                break
        return total

    def drop_cached(self, key: str) -> bool:
        """Forget a local copy of ``key`` held in front of the real store; whether one was held.

        Only caches hold such copies (``cas.blobstore.cache``); readers call this when a cached object
        fails verification, then read it again from the store itself.
        """
        return False

    @property
    def reads_in_place(self) -> bool:
        """Whether ``read_into`` is cheaper than ``get`` (local files), so readers prefer it."""
        return False

    def sync(self) -> None:
        """Make every completed ``put`` durable. A no-op where puts are durable already."""

    def for_background_writes(self) -> BlobStore:
        """The store to give a writer whose blobs nobody reads back soon (a training loop's
        checkpoint stream): the same blobs, possibly written by a cheaper path. By default, itself.
        """
        return self

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Yield ``BlobInfo`` for every key under ``prefix``; backends may batch this."""
        for key in self.list(prefix):
            try:
                yield self.stat(key)
            except FileNotFoundError:
                continue

    def has_many(self, keys: Iterable[str], workers: int = 16) -> dict[str, bool]:
        """Existence of many keys at once."""
        key_list = list(keys)
        if len(key_list) < 4:
            return {key: self.has(key) for key in key_list}
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(zip(key_list, pool.map(self.has, key_list), strict=False))

    def touch_many(self, keys: Iterable[str], workers: int = 16) -> Sequence[str]:
        """Touch many keys at once; return the ones that were not there."""
        key_list = list(keys)

        def touched(key: str) -> bool:
            try:
                self.touch(key)
            except NotFound:
                return False
            return True

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(key_list) or 1))) as pool:
            return [
                k for k, ok in zip(key_list, pool.map(touched, key_list), strict=True) if not ok
            ]

    @property
    def supports_conditional_writes(self) -> bool:
        """Whether compare-and-swap and create-only puts hold against other processes and hosts."""
        return True

    def close(self) -> None:
        """Release connections and file handles."""

    def __enter__(self) -> BlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
