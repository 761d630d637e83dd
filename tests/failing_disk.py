"""FailingDisk: a disk below one directory that fails the n-th file-system call with an errno.

``FaultyBlobStore`` strikes above a backend's edge; this strikes below it, where a real disk
fails: ``os.open``, ``open``, ``write``, ``fsync``, ``rename``, ``link``, ``unlink``, ``stat``,
``scandir``, ``utime``, ``mkdir``... raise ``OSError(EIO)`` (or ``ENOSPC``) as the kernel would,
so a test sees whether every such error leaves the store as the ``BlobStore`` contract says: a
``BackendError``, no partial blob under a final name, no temp file left behind. Only calls on
paths under ``root`` (and on descriptors opened there) count; the patch lasts for the ``with``
block and covers every thread.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

_PATH_CALLS = ("open", "replace", "rename", "link", "unlink", "utime", "stat", "scandir", "mkdir")
_FD_CALLS = ("write", "fsync", "pwrite", "ftruncate")


class FailingDisk:
    """Counts file-system calls under ``root``; ``fail_call(n)`` makes the n-th from now fail."""

    def __init__(self, root: Path, error: int = errno.EIO) -> None:
        self.root = str(root.absolute())
        self.error = error
        self.calls: Counter[str] = Counter()
        self.struck: list[str] = []
        self._countdown: int | None = None
        self._fds: set[int] = set()
        self._lock = threading.Lock()

    def fail_call(self, index: int) -> None:
        """Make the call ``index`` calls from now (0: the next one) fail."""
        with self._lock:
            self._countdown = index

    def _under_root(self, path: object) -> bool:
        if isinstance(path, int) or not isinstance(path, (str, bytes, os.PathLike)):
            return False
        text = os.fsdecode(os.fspath(path))
        absolute = os.path.abspath(text)
        return absolute == self.root or absolute.startswith(self.root + os.sep)

    def _strike(self, call: str, what: object) -> None:
        with self._lock:
            self.calls[call] += 1
            if self._countdown is None:
                return
            if self._countdown > 0:
                self._countdown -= 1
                return
            self._countdown = None
            self.struck.append(call)
        raise OSError(self.error, os.strerror(self.error), os.fsdecode(str(what)))

    def _path_call(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            paths = [a for a in args[:2] if self._under_root(a)]
            if paths:
                self._strike(name, paths[0])
            result = real(*args, **kwargs)
            if name == "open" and paths and isinstance(result, int):
                with self._lock:
                    self._fds.add(result)
            return result

        return call

    def _fd_call(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                ours = fd in self._fds
            if ours:
                self._strike(name, f"fd {fd}")
            return real(fd, *args, **kwargs)

        return call

    def _close(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def close(fd: int) -> None:
            with self._lock:
                self._fds.discard(fd)
            real(fd)

        return close

    def _open_file(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def open_file(file: Any, *args: Any, **kwargs: Any) -> Any:
            if self._under_root(file):
                self._strike("open", file)
            return real(file, *args, **kwargs)

        return open_file

    @contextmanager
    def installed(self) -> Iterator[FailingDisk]:
        """Patch ``os`` and ``open`` for the block."""
        with ExitStack() as stack:
            for name in _PATH_CALLS:
                real = getattr(os, name)
                stack.enter_context(mock.patch.object(os, name, self._path_call(name, real)))
            for name in _FD_CALLS:
                real = getattr(os, name)
                stack.enter_context(mock.patch.object(os, name, self._fd_call(name, real)))
            stack.enter_context(mock.patch.object(os, "close", self._close(os.close)))
            opener = self._open_file(builtins.open)
            stack.enter_context(mock.patch.object(builtins, "open", opener))
            stack.enter_context(mock.patch.object(io, "open", opener))
            yield self
