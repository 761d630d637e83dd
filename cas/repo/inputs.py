"""Reading a file to ingest: private reads, and a check that the file did not change meanwhile.

``cas put`` reads its input with ``pread`` into buffers of its own, never through a mapping: a
file truncated while it is mapped kills the reader with SIGBUS, and the pages of a mapping
change under the reader when the file is rewritten in place. Each chunk is then one private
reading, hashed and written as such (invariant 9). Whether the chunks together are one version
of the file is checked by its status: the size, modification and change times and identity
(device, inode) must be the same after the last read as before the first, and every read must
return all it asked for. Otherwise the put is refused with ``InputChanged`` and no ref moves.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

from cas.errors import FormatError


class InputChanged(FormatError):
    """The file changed while it was read; nothing that names it was committed."""

    def __init__(self, path: Path | str, how: str) -> None:
        super().__init__(
            f"{path} changed while it was being read ({how}); nothing was stored under its "
            "name, try again once it is no longer being written"
        )


def _identity(status: os.stat_result) -> tuple[int, ...]:
    return (
        status.st_dev,
        status.st_ino,
        status.st_size,
        status.st_mtime_ns,
        status.st_ctime_ns,
    )


class InputFile:
    """An input file open for reading by offset, compared at the end with its status before.

    ``before`` is the file's status taken before anything about it was read (its format
    inspected, say); by default the status of the file just opened.
    """

    def __init__(self, path: Path, before: os.stat_result | None = None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            opened = os.fstat(self._fd)
        except BaseException:
            os.close(self._fd)
            raise
        self.before = before or opened
        self.size = self.before.st_size
        self.mode = opened.st_mode & 0o777
        self.mtime_ns = self.before.st_mtime_ns
        if _identity(opened) != _identity(self.before):
            self.close()
            raise InputChanged(path, "it was replaced or written before it was opened")

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset``, in a buffer of their own; InputChanged if the file
        ends before them."""
        data = os.pread(self._fd, size, offset)
        while len(data) < size:
            more = os.pread(self._fd, size - len(data), offset + len(data))
            if not more:
                raise InputChanged(self.path, "it became shorter")
            data += more
        return data

    def read_into(self, offset: int, out: Any) -> None:
        """Fill the writable buffer ``out`` with the bytes from ``offset`` (no buffer of their
        own: ingest reads into the staging pool); InputChanged if the file ends before."""
        view = memoryview(out).cast("B")
        while view:
            got = os.preadv(self._fd, [view], offset)
            if not got:
                raise InputChanged(self.path, "it became shorter")
            view, offset = view[got:], offset + got

    def check_unchanged(self) -> None:
        """InputChanged unless the file's status is still what it was before the first read."""
        if _identity(os.fstat(self._fd)) != _identity(self.before):
            raise InputChanged(self.path, "its size or modification time differ")

    def close(self) -> None:
        """Close the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> InputFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
