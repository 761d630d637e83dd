"""The BlobStore contract: a flat namespace of byte blobs under '/'-separated keys."""

from __future__ import annotations

import errno
import os
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType, TypeAlias

from cas.errors import IntegrityError, InvalidName, NotFound

Version = NewType("Version", str)
"""An opaque token naming one stored version of a blob (an ETag on S3, a content hash locally)."""

BytesLike: TypeAlias = bytes | bytearray | memoryview
Payload: TypeAlias = BytesLike | Sequence[BytesLike]
"""What a put takes: one buffer, or several written one after another as one blob (a chunk's
header and its payload), which a backend may send without joining them first."""

_KEY_SEGMENT_RE = re.compile(r"[A-Za-z0-9._%@+=,~-]+\Z")


@dataclass(frozen=True)
class BlobInfo:
    """What ``stat`` and ``list_info`` report about one blob."""

    key: str
    size: int
    mtime: float
    """Seconds since the epoch of the last write or ``touch``."""


def open_local_blob(path: str | os.PathLike[str], key: str) -> int:
    """A read-only descriptor of the file holding blob ``key``, opened without blocking.

    Only a regular file is a blob: a FIFO, device or socket planted under a blob's name (by
    accident or by a hostile hand) is IntegrityError, damage to report, never a read that waits
    forever for a writer or returns a device's endless bytes. NotFound if there is no file;
    OSError for anything else the disk says.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        raise NotFound(f"no blob {key!r}") from e
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a FIFO opened for writing) has no reader side
            raise IntegrityError(f"blob {key!r} is a socket, not a regular file") from e
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise NotFound(f"no blob {key!r}: a directory of blobs")
        raise IntegrityError(f"blob {key!r} is {file_kind(mode)}, not a regular file")
    return fd


def file_kind(mode: int) -> str:
    """What a file of ``mode`` that is not a regular file is, for a message: "a FIFO"..."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise InvalidName."""
    if not key or key.startswith("/") or key.endswith("/"):
        raise InvalidName(f"invalid blob key {key!r}")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or not _KEY_SEGMENT_RE.match(segment):
            raise InvalidName(f"invalid blob key {key!r}")
    return key


def parts_of(data: Payload) -> Sequence[BytesLike]:
    """``data`` as a sequence of buffers (one buffer is a sequence of one)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return (data,)
    return data


def joined(data: Payload) -> BytesLike:
    """``data`` as one buffer; a single buffer is returned as it is, without a copy."""
    parts = parts_of(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class BlobStore(ABC):
    """A flat key -> bytes store; the only thing cas needs from a storage backend.

    Contract every backend and wrapper meets (``cas.testing.BlobStoreConformance`` checks it):

    - Keys are '/'-separated relative paths (``check_key``); an unsafe key raises InvalidName
      from every method. ``list_info(prefix)`` and ``list(prefix)`` yield every blob whose key
      starts with ``prefix`` as a plain string prefix, once each, in no particular order, and
      never a "directory" (a key that is only a prefix of other keys is no blob: ``stat`` of it
      raises NotFound).
    - ``put`` is atomic: a reader sees the old blob, no blob, or the whole new one, never a
      prefix, and a crash during ``put`` leaves no partial blob under ``key``.
    - Read-after-write: once a write returns, ``get``, ``has``, ``stat`` and listings in this and
      every other process see it; once ``delete`` returns, they do not.
    - A missing key raises ``cas.errors.NotFound`` (also a ``FileNotFoundError``) from ``get``,
      ``get_range`` (even an empty range), ``stat``, ``get_versioned`` and ``touch``; ``delete``
      of a missing key is not an error.
    - Durability: blobs written by ``put`` and ``put_if_absent`` survive a power loss once
      ``sync()`` has returned; ``put_conditional`` and ``delete_conditional`` are durable when
      they return; ``put_transient`` never promises to survive a crash of this machine.
    - ``put_if_absent`` is create-only: of several writers of one key, exactly one gets True and
      its bytes stay; the others get False and change nothing.
    - Conditional writes compare and swap on a ``Version``: ``put_conditional(key, data, None)``
      creates only if absent, otherwise it replaces only if the current version equals
      ``expected``; ``delete_conditional`` likewise. A loser gets ``PreconditionFailed`` and
      nothing changes. Rewriting the same bytes may keep the version (local stores hash the
      content), so payloads several writers write carry something unique to the writer.
    - Create-only and compare-and-swap hold across processes and hosts where
      ``supports_conditional_writes`` is true, and between threads of one process elsewhere.
    - ``touch`` moves the modification time forward and keeps the bytes and the version.
    - Backend failures are translated to ``cas.errors.BackendError`` (``TransientBackendError``
      when a retry may succeed) with ``raise ... from``, at the backend's edge.

    Eleven methods are abstract. ``has`` and ``list`` follow from ``stat`` and ``list_info``;
    the methods with defaults below them, and the capability properties, describe abilities
    only some stores have. A wrapper (``BlobStoreWrapper``) forwards all of them. Operations on
    many keys at once are functions in ``cas.blobstore.bulk``.
    """

    url: str = ""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole blob."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)`` of the blob, clamped to its size."""

    @abstractmethod
    def stat(self, key: str) -> BlobInfo:
        """Size and modification time of one blob."""

    @abstractmethod
    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        """Yield ``BlobInfo`` for every blob whose key starts with ``prefix``."""

    @abstractmethod
    def put(self, key: str, data: Payload) -> None:
        """Store ``data`` under ``key`` atomically, replacing any previous blob."""

    @abstractmethod
    def put_if_absent(self, key: str, data: Payload) -> bool:
        """Store ``data`` only if ``key`` holds no blob yet; whether this call created it.

        Chunks are written this way: the same chunk may be encoded differently (as a delta
        against another base) by two writers, and the loser must learn which encoding is stored
        rather than replace one that a committed manifest may already depend on.
        """

    def put_if_absent_named(self, key_of: Callable[[], str], data: Payload) -> bool:
        """``put_if_absent`` under the key ``key_of()`` returns, which a store may ask for only
        once it has written the bytes aside: a local store writes its temp file first, so a
        chunk's name (its hash) is computed while the disk writes. Here, the name first."""
        return self.put_if_absent(key_of(), data)

    @abstractmethod
    def touch(self, key: str) -> None:
        """Move the blob's modification time to now, so age-based GC treats it as new."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the blob if present."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        """Return the blob and the version token to pass to ``put_conditional``."""

    @abstractmethod
    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        """Compare-and-swap write; ``expected=None`` means the key must not exist yet."""

    @abstractmethod
    def delete_conditional(self, key: str, expected: Version) -> None:
        """Delete only if the current version is ``expected``."""

    def has(self, key: str) -> bool:
        """Whether a blob exists under ``key``."""
        try:
            self.stat(key)
        except NotFound:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key starting with ``prefix``; a store may skip the sizes to answer faster."""
        for info in self.list_info(prefix):
            yield info.key

    def put_transient(self, key: str, data: BytesLike) -> None:
        """Store ``data`` like ``put``, visible to every reader at once, but with no promise that
        it survives a crash of this machine.

        For blobs whose meaning dies with the writer, a writer lease above all: after a crash no
        writer holds it. Stores where durability costs nothing extra keep the default, ``put``.
        """
        self.put(key, data)

    def sync(self) -> None:
        """Make every completed ``put`` durable. A no-op where puts are durable already."""

    def drop_cached(self, key: str) -> bool:
        """Forget a local copy of ``key`` held in front of the real store; whether one was held.

        Only caches hold such copies (``cas.blobstore.cache``); readers call this when a cached
        object fails verification, then read it again from the store itself.
        """
        return False

    def for_background_writes(self) -> BlobStore:
        """The store to give a writer whose blobs nobody reads back soon (a training loop's
        checkpoint stream): the same blobs, possibly written by a cheaper path. By default, itself.
        """
        return self

    def close(self) -> None:
        """Release connections and file handles."""

    @property
    def accepts_deletes(self) -> bool:
        """Whether this handle may delete data (refs, chunks, manifests); False for a handle
        opened append-only, which refuses before any request."""
        return True

    @property
    def supports_conditional_writes(self) -> bool:
        """Whether compare-and-swap and create-only puts hold against other processes and hosts.

        Where false they hold between the threads of one process only.
        """
        return False

    @property
    def mtime_resolution(self) -> float:
        """How far below the storage's clock at a write the mtime it reports may be, in seconds:
        S3 counts whole seconds, the default for stores that do not say; a local file system's
        coarse clock lags by up to a tick. Offsets to the storage's clock allow for it."""
        return 1.0

    @property
    def local_root(self) -> Path | None:
        """The directory on this machine whose files are the blobs, ``local_root / key``, or None.

        Readers may read those files in place (``bulk.read_into``) and map them into memory,
        never write them. None for remote stores and for wrappers whose reads must go through
        the wrapper (a cache, whose remote is the truth).
        """
        return None

    @property
    def supports_rename(self) -> bool:
        """Whether the files under ``local_root`` may be renamed aside and back by this store's
        owner: GC moves a candidate into its trash, looks at its age there, and only then
        deletes it, so a writer's concurrent ``touch`` is never lost. False for read-only views.
        """
        return False

    @property
    def reads_in_place(self) -> bool:
        """Whether blobs are files to read into a caller's buffers, cheaper than ``get``."""
        return self.local_root is not None

    def read_into_buffers(self, key: str, start: int, outs: Sequence[memoryview]) -> int | None:
        """Fill ``outs`` in order with the blob's bytes from ``start`` by a path of this store's
        own, and return how many were read (fewer only at the blob's end); None when it has
        none, and ``bulk.read_into`` reads ``local_path`` or a range. A sealed store decrypts a
        local file straight into ``outs`` here (``cas.blobstore.sealed``).
        """
        return None

    def local_path(self, key: str) -> Path | None:
        """The file that holds ``key`` (it may not exist) when ``local_root`` is set, else None."""
        root = self.local_root
        return None if root is None else root / check_key(key)

    def __enter__(self) -> BlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
