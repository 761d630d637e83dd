"""FsspecBlobStore: blobs as files on any fsspec filesystem (memory, local, sftp, gcs, s3fs...).

This is also the S3 route for users who already hold an fsspec filesystem: hand an
``s3fs.S3FileSystem`` to ``cas.open(url, filesystem=fs)`` (or ``FsspecBlobStore(fs, "bucket/prefix")``)
and cas stores its blobs through it. ``s3://`` URLs without one open ``S3BlobStore`` instead,
which adds compare-and-swap (conditional writes) that fsspec cannot express, so several writers
may share the bucket.

Atomic put depends on the filesystem, so the store picks one of two strategies:

- Filesystems with directories and an atomic rename (local, sftp, hdfs): write
  ``<root>/tmp/<random>.tmp``, then ``fs.mv`` it over the final name.
- Object stores and the in-memory filesystem: write the final name directly; a single-object
  write becomes visible whole there, and a rename would be a second full copy.

Pass ``atomic_rename`` to override the choice for a filesystem this module does not know.
Durability is whatever the filesystem gives (the local one does not fsync; use
``LocalBlobStore`` for local disks).

fsspec has no compare-and-swap, so ``supports_conditional_writes`` is False. The conditional
methods still work within one process: they compare a content digest and write while holding one
process-wide lock. Two processes or hosts can both pass the check and lose an update.

Nor has it a portable create-only write, so ``put_if_absent`` (chunk writes) is ``has`` then
write under a per-key lock: two threads of one process never both create a chunk, but two
processes or hosts can, and the last write wins.

Filesystems that cache listings (s3fs) are asked to forget them before each ``stat`` and
listing, so blobs written by other processes are seen at once, as the contract asks.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from cas.blobstore.base import (
    BlobInfo,
    BlobStore,
    BytesLike,
    Payload,
    Version,
    check_key,
    joined,
)
from cas.digest import digest_of
from cas.errors import BackendError, NotFound, PreconditionFailed, TransientBackendError

TMP_DIR = "tmp"
_READS = frozenset({"get", "get_range", "stat"})
"""Operations for which a key too long to be a file name is simply not there."""
"""Temporary files for rename-based puts; never listed as blobs."""

RENAME_ATOMIC_PROTOCOLS = frozenset({"file", "local", "sftp", "ssh", "hdfs", "arrow_hdfs"})

_MTIME_FIELDS = ("mtime", "LastModified", "last_modified", "modified", "updated", "created")

# One lock for every fsspec store in the process: two stores over the same filesystem must not
# interleave their check-then-write, and conditional writes (refs) are rare enough to serialize.
_CONDITIONAL_LOCK = threading.Lock()

# ``put_if_absent`` holds one of these (by key) across its check and its write, so two threads of
# one process never both create a key; striped so unrelated keys rarely wait.
_CREATE_LOCKS = tuple(threading.Lock() for _ in range(256))


class FsspecBlobStore(BlobStore):
    """Blobs as files below ``root`` on the fsspec filesystem ``fs``."""

    def __init__(
        self,
        fs: Any,
        root: str,
        *,
        url: str | None = None,
        atomic_rename: bool | None = None,
    ) -> None:
        self.fs = fs
        self._root = fs._strip_protocol(root).rstrip("/")
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self.url = url or str(fs.unstrip_protocol(self._root))
        if atomic_rename is None:
            atomic_rename = bool(protocols & RENAME_ATOMIC_PROTOCOLS)
        self.atomic_rename = atomic_rename

    @classmethod
    def from_url(cls, url: str, **storage_options: Any) -> FsspecBlobStore:
        """Open any fsspec URL, e.g. ``memory://scratch`` or ``gcs://bucket/prefix``."""
        atomic_rename = storage_options.pop("atomic_rename", None)
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as e:
            raise BackendError(f"cannot open {url!r} with fsspec: {e}") from e
        return cls(fs, root, url=url, atomic_rename=atomic_rename)

    @classmethod
    def on(cls, fs: Any, url: str, **options: Any) -> FsspecBlobStore:
        """Open ``url`` (``s3://bucket/prefix``, or a bare path) on the filesystem ``fs``."""
        unknown = sorted(set(options) - {"atomic_rename"})
        if unknown:
            raise TypeError(f"unknown options {unknown} for a store on an fsspec filesystem")
        return cls(fs, url, url=url if "://" in url else None, **options)

    def _path(self, key: str) -> str:
        return f"{self._root}/{check_key(key)}"

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        """Translate filesystem errors into the cas error tree at this edge."""
        try:
            yield
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise NotFound(f"no blob {key!r} in {self.url}") from e
        except (TimeoutError, ConnectionError) as e:
            raise TransientBackendError(f"{op} {key!r} in {self.url}: {e}") from e
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG and op in _READS:
                raise NotFound(f"no blob {key!r} in {self.url}: no file can have that name") from e
            raise BackendError(f"{op} {key!r} in {self.url}: {e}") from e

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._errors("get", key):
            return bytes(self.fs.cat_file(path))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        if end <= start:
            self.stat(key)  # an empty range of a missing blob still raises NotFound
            return b""
        try:
            with self._errors("get_range", key):
                return bytes(self.fs.cat_file(path, start=start, end=end))
        except BackendError as e:
            if isinstance(e, NotFound) or start < self.stat(key).size:
                raise
            return b""  # object stores (s3fs) refuse a range that starts past the end

    def put(self, key: str, data: Payload) -> None:
        path = self._path(key)
        with self._errors("put", key):
            self._write(path, data)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        """``has``, then ``put``, under a per-key lock: create-only within this process only."""
        with _CREATE_LOCKS[hash(key) % len(_CREATE_LOCKS)]:
            if self.has(key):
                return False
            self.put(key, data)
            return True

    def _write(self, path: str, data: Payload) -> None:
        payload = bytes(joined(data))
        if not self.atomic_rename:
            self.fs.pipe_file(path, payload)
            return
        tmp_dir = f"{self._root}/{TMP_DIR}"
        tmp = f"{tmp_dir}/{uuid.uuid4().hex}.tmp"
        self.fs.makedirs(tmp_dir, exist_ok=True)
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        self.fs.pipe_file(tmp, payload)
        try:
            self.fs.mv(tmp, path)
        except BaseException:
            with suppress(OSError):
                self.fs.rm_file(tmp)
            raise

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            with self._errors("delete", key):
                self.fs.rm_file(path)
        except NotFound:
            return

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        # Start at the deepest directory the prefix names so listing chunks/ab skips the rest.
        base_dir, _, _ = prefix.rpartition("/")
        base = f"{self._root}/{base_dir}" if base_dir else self._root or "/"
        root_len = len(self._root) + 1
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return
        except OSError as e:
            raise BackendError(f"list {prefix!r} in {self.url}: {e}") from e
        for path, info in found.items():
            key = path[root_len:]
            if key.startswith(prefix) and not key.startswith(f"{TMP_DIR}/"):
                yield BlobInfo(key, int(info.get("size") or 0), _mtime(info))

    def stat(self, key: str) -> BlobInfo:
        path = self._path(key)
        self.fs.invalidate_cache(path)
        with self._errors("stat", key):
            info = self.fs.info(path)
        if info.get("type") != "file":
            raise NotFound(f"no blob {key!r} in {self.url}")
        return BlobInfo(key, int(info.get("size") or 0), _mtime(info))

    def touch(self, key: str) -> None:
        """Bump the mtime in place on a local filesystem; elsewhere rewrite the blob.

        ``fs.touch`` is avoided on purpose: if the blob vanished in between, it would create an
        empty file under a content-addressed name.
        """
        if isinstance(self.fs, LocalFileSystem):
            path = self._path(key)
            if not self.has(key):  # utime would accept a directory
                raise NotFound(f"no blob {key!r} in {self.url}")
            with self._errors("touch", key):
                os.utime(self.fs._strip_protocol(path))
            return
        self.put(key, self.get(key))

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        data = self.get(key)
        return data, Version(digest_of(data))

    def _current_version(self, key: str) -> Version | None:
        try:
            return self.get_versioned(key)[1]
        except NotFound:
            return None

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        """Check-then-write under a process-wide lock; not safe across processes or hosts."""
        payload = bytes(data)
        with _CONDITIONAL_LOCK:
            current = self._current_version(key)
            if current != expected:
                raise PreconditionFailed(f"{key!r} changed (expected {expected}, found {current})")
            self.put(key, payload)
        return Version(digest_of(payload))

    def delete_conditional(self, key: str, expected: Version) -> None:
        """Check-then-delete under a process-wide lock; not safe across processes or hosts."""
        with _CONDITIONAL_LOCK:
            current = self._current_version(key)
            if current != expected:
                raise PreconditionFailed(f"{key!r} changed (expected {expected}, found {current})")
            self.delete(key)


def _mtime(info: dict[str, Any]) -> float:
    """Seconds since the epoch from whichever timestamp field this filesystem reports."""
    for field in _MTIME_FIELDS:
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0
