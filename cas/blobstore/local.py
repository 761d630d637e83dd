"""LocalBlobStore: blobs as files under a directory, written by temp file, fsync and rename."""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from stat import S_ISREG

from cas.blobstore.base import (
    BlobInfo,
    BlobStore,
    BytesLike,
    Payload,
    Version,
    check_key,
    open_local_blob,
    parts_of,
)
from cas.blobstore.direct import AlignedBuffers, DirectIOUnsupported, wants_direct, write_direct
from cas.blobstore.tempfiles import WriterTemps, remove_dead
from cas.digest import digest_of
from cas.errors import BackendError, CASError, NotFound, PreconditionFailed
from cas.threads import LentPool

TMP_DIR = "tmp"
"""Temporary files live here, never under a final name: each writing handle's in its own locked
directory (``cas.blobstore.tempfiles``), removed once the handle is certainly gone."""
LOCK_DIR = "tmp/locks"

_MAX_READ = 0x7FFFF000
"""The most one ``read`` returns on Linux; short of that, a short read of a file is its end."""
_MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)
"""What opening a key that names no file raises: no file, a directory of blobs, or a path
running through a blob as if it were a directory."""


@contextmanager
def disk_errors(doing: str, path: Path | str) -> Iterator[None]:
    """Raise any ``OSError`` of the block (a full or failing disk, no permission) as the
    ``BackendError`` the contract promises, naming what was being done to which file.

    The edge of every module that works on a local store's files itself (this store, the
    sweeper, the object inventory); ``CASError`` passes through, though ``BackendError`` and
    ``NotFound`` are ``OSError`` too.
    """
    try:
        yield
    except CASError:
        raise
    except OSError as e:
        raise _backend_error(doing, path, e) from e


def _backend_error(doing: str, path: Path | str, error: OSError) -> BackendError:
    return BackendError(f"{doing} {path}: {error.strerror or error}")


def _discard(tmp: Path) -> None:
    """Remove a temp file that will never be published; a disk that fails even that leaves it
    in ``tmp/``, where no reader looks and GC removes it."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


class LocalBlobStore(BlobStore):
    """Blobs as files below ``root``.

    ``put`` writes ``root/tmp/writers/<handle>/<random>.tmp``, fsyncs it and renames it over the
    final name, so a crash leaves at most a stray temp file, which the next writer to open the
    store (or GC) removes once the handle's lock shows it is gone. ``put_if_absent`` writes the
    temp file the same way and hard-links it to the final name, which fails if the name exists.
    Directories touched by ``put`` are fsynced by ``sync``; conditional writes hold an ``flock``
    on a per-key lock file and fsync at once.

    With ``direct_io=True`` (what ``for_background_writes`` returns) blobs from 1 MiB to 64 MiB,
    chunks in practice, are written with ``O_DIRECT`` where the filesystem takes it
    (``cas.blobstore.direct``): no fresh page-cache pages are faulted in, so a full save runs
    near the disk's speed and a background save costs a training loop far less CPU.
    ``ObjectStore`` writes every new chunk through such a handle; manifests, refs and small
    blobs stay buffered here.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = True, direct_io: bool = False
    ) -> None:
        self.root = Path(root).absolute()
        self._root_str = str(self.root)
        self.url = self.root.as_uri()
        self._fsync = fsync
        self._direct_io = direct_io
        self._aligned = AlignedBuffers()
        self._dirty_dirs: set[Path] = set()
        self._dirty_lock = threading.Lock()
        self._known_dirs: set[Path] = set()
        self._temps = WriterTemps(self.root / TMP_DIR)
        self._prepared = False
        """Whether ``tmp/locks`` exists: made on the first write, so that opening a store that is
        not there (``cas --store typo ls``, tab completion) leaves nothing behind."""

    def _prepare(self) -> None:
        if self._prepared:
            return
        try:
            (self.root / LOCK_DIR).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BackendError(f"cannot create store directory {self.root}: {e.strerror}") from e
        with contextlib.suppress(OSError):  # housekeeping: GC removes what is left
            remove_dead(self.root / TMP_DIR)
        self._prepared = True

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str) -> bytes:
        return self._read(key, 0, None)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._read(key, start, max(0, end - start))

    def _read(self, key: str, start: int, length: int | None) -> bytes:
        """``length`` bytes of the blob from ``start`` (to its end if None; fewer at its end).

        One ``open``, ``fstat`` and ``pread`` on a string path: a load reads a file per chunk,
        and Python's buffered file object and ``pathlib`` cost as much again as the reading of a
        small chunk from the page cache."""
        path = os.path.join(self._root_str, check_key(key))
        try:
            fd = open_local_blob(path, key)
            try:
                if length is None:
                    length = max(0, os.fstat(fd).st_size - start)
                data = os.pread(fd, length, start)
                if _MAX_READ <= len(data) < length:  # one read stops there: gather the rest
                    parts = [data]
                    got = len(data)
                    while got < length:
                        more = os.pread(fd, length - got, start + got)
                        if not more:
                            break
                        parts.append(more)
                        got += len(more)
                    data = b"".join(parts)
                return data
            finally:
                os.close(fd)
        except _MISSING as e:
            raise NotFound(f"no blob {key!r}") from e
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                raise NotFound(f"no blob {key!r}: no file can have that name") from e
            raise BackendError(f"reading {path}: {e.strerror}") from e

    @property
    def local_root(self) -> Path:
        return self.root

    def close(self) -> None:
        """Give up this handle's temp directory (a later write takes a new one)."""
        self._temps.close()

    @property
    def mtime_resolution(self) -> float:
        """A file's mtime comes from the kernel's coarse clock, up to a tick (<= 10 ms) behind."""
        return 0.01

    @property
    def supports_rename(self) -> bool:
        return True

    @property
    def supports_conditional_writes(self) -> bool:
        """True: ``link`` creates only if absent, and compare-and-swap holds an ``flock``."""
        return True

    def _ensure_parent(self, path: Path) -> list[Path]:
        """Make ``path``'s directory where it is missing; the directories that gained an entry
        for a new one (each new level's parent). A new directory lasts a crash once its parent
        is fsynced too: ext4 without a journal does that by itself, POSIX does not promise it."""
        parent = path.parent
        if parent in self._known_dirs:
            return []
        missing: list[Path] = []
        level = parent
        while not level.is_dir():
            missing.append(level)
            level = level.parent
        for made in reversed(missing):
            made.mkdir(exist_ok=True)  # or another writer's: its entry is made durable here too
        self._known_dirs.add(parent)
        return [made.parent for made in missing]

    def for_background_writes(self) -> LocalBlobStore:
        """A second handle on the same directory whose large blobs go past the page cache.

        A shallow copy, so a subclass keeps its type and overrides; like a second process, it
        shares only the files (writes are atomic and create-only, refs take ``flock``).
        """
        if self._direct_io:
            return self
        handle = copy.copy(self)
        handle._direct_io = True
        handle._aligned = AlignedBuffers()
        handle._temps = WriterTemps(self.root / TMP_DIR)  # its own lock: closed on its own
        handle._dirty_dirs = set()
        handle._dirty_lock = threading.Lock()
        return handle

    @property
    def direct_io(self) -> bool:
        """Whether large blobs are still written with ``O_DIRECT`` (off once the filesystem refused)."""
        return self._direct_io

    def _write_temp(self, *parts: BytesLike, fsync: bool = True) -> Path:
        self._prepare()
        tmp = self._temps.directory() / f"{uuid.uuid4().hex}.tmp"
        fsync = fsync and self._fsync
        if self._direct_io:
            total = sum(memoryview(part).nbytes for part in parts)
            if wants_direct(total):
                try:
                    write_direct(tmp, parts, total, self._aligned, fsync=fsync)
                    return tmp
                except DirectIOUnsupported:
                    self._direct_io = False  # this filesystem refuses it: buffered from now on
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _discard(tmp)
            raise
        os.close(fd)
        return tmp

    def put(self, key: str, data: Payload) -> None:
        self._replace(key, parts_of(data), durable=True)

    def put_transient(self, key: str, data: BytesLike) -> None:
        """Atomic and visible to other processes at once, like ``put``, but with neither the file's
        nor its directory's fsync: a checkpoint save writes a lease, and no crash needs one."""
        self._replace(key, (data,), durable=False)

    def _replace(self, key: str, parts: Sequence[BytesLike], *, durable: bool) -> None:
        """Write a temp file and rename it over ``key``; a durable write's directory is fsynced
        by the next ``sync``."""
        path = self._path(key)
        with disk_errors("writing", path):
            grown = self._ensure_parent(path)
            tmp = self._write_temp(*parts, fsync=durable)
            try:
                os.replace(tmp, path)
            except BaseException:
                _discard(tmp)
                raise
        if durable:
            with self._dirty_lock:
                self._dirty_dirs.update((path.parent, *grown))

    def put_if_absent(self, key: str, data: Payload) -> bool:
        """Create-only, atomic across processes: ``link`` never replaces an existing name.

        Durable after ``sync``, like ``put``: the temp file is fsynced before it is linked, and
        the directory holding the new name is fsynced by ``sync``.
        """
        self._path(key)  # a key no file may have fails before anything is written
        return self._create(lambda: key, data)

    def put_if_absent_named(self, key_of: Callable[[], str], data: Payload) -> bool:
        """``put_if_absent``, the temp file written and fsynced before ``key_of`` is asked; the
        name first where a subclass overrides ``put_if_absent``, so it sees every create."""
        if type(self).put_if_absent is not LocalBlobStore.put_if_absent:
            return self.put_if_absent(key_of(), data)
        return self._create(key_of, data)

    def _create(self, key_of: Callable[[], str], data: Payload) -> bool:
        path: Path | None = None
        grown: list[Path] = []
        try:
            tmp = self._write_temp(*parts_of(data))
            try:
                path = self._path(key_of())
                grown = self._ensure_parent(path)
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _discard(tmp)  # the blob keeps its own name; drop the temp one
        except OSError as e:
            raise BackendError(f"writing {path or self.root}: {e.strerror}") from e
        assert path is not None  # linked under it
        with self._dirty_lock:
            self._dirty_dirs.update((path.parent, *grown))
        return True

    def sync(self) -> None:
        with self._dirty_lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        if not self._fsync:
            return
        failed: list[Path] = []
        try:
            _fsync_dirs(list(dirs), failed)
        finally:
            if failed:
                # Still not durable: the next sync tries these again rather than forget them.
                with self._dirty_lock:
                    self._dirty_dirs.update(failed)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except _MISSING:
            return
        except OSError as e:
            raise BackendError(f"deleting {path}: {e.strerror}") from e

    def list(self, prefix: str = "") -> Iterator[str]:
        for info in self._walk(prefix, with_stat=False):
            yield info.key

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        yield from self._walk(prefix, with_stat=True)

    def _walk(self, prefix: str, *, with_stat: bool) -> Iterator[BlobInfo]:
        # Start at the deepest directory the prefix names so listing chunks/ab skips the rest.
        base_dir, _, _ = prefix.rpartition("/")
        start = self.root / base_dir if base_dir else self.root
        root_len = len(str(self.root)) + 1
        stack = [start]
        while stack:
            directory = stack.pop()
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise _backend_error("listing", directory, e) from e
            with entries:
                for entry in entries:
                    rel = entry.path[root_len:]
                    if rel == TMP_DIR:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        if (rel + "/").startswith(prefix) or prefix.startswith(rel + "/"):
                            stack.append(Path(entry.path))
                    elif rel.startswith(prefix):  # temp files live only in tmp/
                        if with_stat:
                            try:
                                st = entry.stat()
                            except FileNotFoundError:
                                continue
                            except OSError as e:
                                raise _backend_error("listing", entry.path, e) from e
                            yield BlobInfo(rel, st.st_size, st.st_mtime)
                        else:
                            yield BlobInfo(rel, -1, 0.0)

    def stat(self, key: str) -> BlobInfo:
        path = self._path(key)
        try:
            st = path.stat()
        except _MISSING as e:
            raise NotFound(f"no blob {key!r}") from e
        except OSError as e:
            raise _backend_error("reading the size of", path, e) from e
        if not S_ISREG(st.st_mode):
            raise NotFound(f"no blob {key!r}: a directory of blobs")
        return BlobInfo(key, st.st_size, st.st_mtime)

    def touch(self, key: str) -> None:
        path = self._path(key)
        try:
            if path.is_dir():
                raise NotFound(f"no blob {key!r}: a directory of blobs")
            os.utime(path)
        except CASError:
            raise
        except _MISSING as e:
            raise NotFound(f"no blob {key!r}") from e
        except OSError as e:
            raise _backend_error("touching", path, e) from e

    @contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        self._prepare()
        lock_path = self.root / LOCK_DIR / f"{digest_of(key.encode())[:32]}.lock"
        with disk_errors("locking", lock_path):
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with disk_errors("locking", lock_path):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _current_version(self, path: Path) -> Version | None:
        try:
            fd = open_local_blob(path, str(path.relative_to(self.root)))
        except NotFound:
            return None
        except OSError as e:
            raise _backend_error("reading", path, e) from e
        try:
            with open(fd, "rb") as f:
                return Version(digest_of(f.read()))
        except OSError as e:
            raise _backend_error("reading", path, e) from e

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        data = self.get(key)
        return data, Version(digest_of(data))

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        path = self._path(key)
        with self._key_lock(key):
            current = self._current_version(path)
            if current != expected:
                raise PreconditionFailed(f"{key!r} changed (expected {expected}, found {current})")
            with disk_errors("writing", path):
                grown = self._ensure_parent(path)
                tmp = self._write_temp(data)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    _discard(tmp)
                    raise
                if self._fsync:
                    for directory in (path.parent, *grown):  # deepest first
                        _fsync_dir(directory)
        return Version(digest_of(bytes(data)))

    def delete_conditional(self, key: str, expected: Version) -> None:
        path = self._path(key)
        with self._key_lock(key):
            current = self._current_version(path)
            if current != expected:
                raise PreconditionFailed(f"{key!r} changed (expected {expected}, found {current})")
            with disk_errors("deleting", path):
                path.unlink()
                if self._fsync:
                    _fsync_dir(path.parent)


SYNC_THREADS = 16
"""Directories fsynced at once by ``sync``. A save of 1 GiB in 4 MiB chunks touches some 200
chunk directories; fsynced one after another they cost 0.1 s (a journal commit each), while
concurrent fsyncs share commits."""


def _fsync_dirs(dirs: list[Path], failed: list[Path]) -> None:
    """fsync every directory of ``dirs``, several at once; those not made durable are added to
    ``failed`` and the first error is raised once all have been tried."""

    def one(directory: Path) -> BackendError | None:
        try:
            with disk_errors("making durable the directory", directory):
                _fsync_dir(directory)
        except BackendError as e:
            return e
        return None

    if len(dirs) <= 2:
        errors = [one(directory) for directory in dirs]
    else:
        pool = LentPool(SYNC_THREADS, "cas-sync")  # the last commit's threads (cas.threads)
        try:
            errors = list(pool.map(one, dirs))
        finally:
            pool.shutdown()
    failed.extend(d for d, e in zip(dirs, errors, strict=True) if e is not None)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)
