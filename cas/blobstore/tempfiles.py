"""A local store's temp files, each writer's under a lock, so a killed writer's are known for certain.

A local store writes every blob to a temp file, then renames or links it to its name; a writer
killed in between leaves the temp file behind. Each store handle that writes owns a directory
``tmp/writers/<id>/`` for its temp files and holds an ``flock`` on ``tmp/writers/<id>.lock`` while
it is open. The kernel releases that lock when the process ends, however it ends (``SIGKILL``
too), and the lock is the same in every PID namespace and container that shares the files. A
lock that can be taken therefore names a writer that is certainly gone (or closed), and its
files are garbage whatever their age: the next writer to open the store removes them
(``remove_dead``), and GC lists and removes them too. No host name, pid or clock is trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

WRITERS_DIR = "writers"
"""Under the store's ``tmp/``: one directory and one lock file per writing handle."""
LOCK_SUFFIX = ".lock"
NEW_SUFFIX = ".new"
NEW_MIN_AGE = 60.0
"""Seconds a lock file still being created (``.<id>.new``) is left alone: it is locked a moment
after it is created, and only one whose creator died in that moment is garbage."""


class WriterTemps:
    """The temp directory of one writing handle, made and locked on first use."""

    def __init__(self, tmp_root: Path) -> None:
        self.base = tmp_root / WRITERS_DIR
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._fd: int | None = None

    def directory(self) -> Path:
        """Where this handle writes its temp files; its lock is held from before it exists."""
        with self._lock:
            if self._dir is None:
                self.base.mkdir(parents=True, exist_ok=True)
                owner = uuid.uuid4().hex
                # Created under a name no sweeper takes, locked, then renamed: a visible lock
                # file is locked from the moment it can be seen.
                fresh = self.base / f".{owner}{NEW_SUFFIX}"
                fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.rename(fresh, self.base / f"{owner}{LOCK_SUFFIX}")
                    (self.base / owner).mkdir()
                except BaseException:
                    os.close(fd)
                    raise
                self._fd, self._dir = fd, self.base / owner
            return self._dir

    def close(self) -> None:
        """Release the lock, removing the directory and lock file if no temp file is left (one
        that is, a failed write's, goes with the next sweep)."""
        with self._lock:
            if self._dir is None or self._fd is None:
                return
            with contextlib.suppress(OSError):
                _remove_owner(self.base, self._dir.name, set())
            os.close(self._fd)
            self._dir = self._fd = None


def dead_files(tmp_root: Path) -> list[tuple[str, int]]:
    """The temp files of writers that are certainly gone: names relative to ``tmp/``, sizes."""
    found: list[tuple[str, int]] = []
    base = tmp_root / WRITERS_DIR
    for owner in _free_owners(base):
        with contextlib.suppress(FileNotFoundError), os.scandir(base / owner) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    size = entry.stat(follow_symlinks=False).st_size
                    found.append((f"{WRITERS_DIR}/{owner}/{entry.name}", size))
    return found


def remove_dead(tmp_root: Path, names: Iterable[str] | None = None) -> tuple[int, int]:
    """Remove the temp files of writers that are certainly gone (of those, only ``names`` if
    given, as ``dead_files`` spells them); return how many and their bytes."""
    base = tmp_root / WRITERS_DIR
    wanted: dict[str, set[str]] | None = None
    if names is not None:
        wanted = {}
        for name in names:
            parts = name.split("/")
            if len(parts) == 3 and parts[0] == WRITERS_DIR:
                wanted.setdefault(parts[1], set()).add(parts[2])
    count = size = 0
    for owner in _free_owners(base):
        if wanted is not None and owner not in wanted:
            continue
        removed, removed_bytes = _remove_owner(
            base, owner, None if wanted is None else wanted[owner]
        )
        count += removed
        size += removed_bytes
    _remove_stale_new(base)
    return count, size


def _free_owners(base: Path) -> list[str]:
    """Owners whose lock can be taken: their writer is gone or closed."""
    try:
        names = [e.name for e in os.scandir(base) if e.name.endswith(LOCK_SUFFIX)]
    except FileNotFoundError:
        return []
    return [name[: -len(LOCK_SUFFIX)] for name in names if _lock_is_free(base / name)]


def _lock_is_free(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # the lock goes with it; a dead writer's stays free
    return True


def _remove_owner(base: Path, owner: str, only: set[str] | None) -> tuple[int, int]:
    """Remove an owner's temp files (``only`` those), then its directory and lock when empty."""
    count = size = 0
    directory = base / owner
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if only is not None and entry.name not in only:
                continue
            with contextlib.suppress(FileNotFoundError):
                entry_size = entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                count += 1
                size += entry_size
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return count, size  # not empty: the lock stays until its files go
    with contextlib.suppress(FileNotFoundError):
        os.unlink(base / f"{owner}{LOCK_SUFFIX}")
    return count, size


def _remove_stale_new(base: Path) -> None:
    """Lock files whose creator died between creating and locking them."""
    cutoff = time.time() - NEW_MIN_AGE
    with contextlib.suppress(FileNotFoundError), os.scandir(base) as entries:
        for entry in entries:
            if not entry.name.endswith(NEW_SUFFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime < cutoff and _lock_is_free(Path(entry.path)):
                    os.unlink(entry.path)
