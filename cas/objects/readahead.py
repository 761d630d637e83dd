"""Read-ahead for loads from a cold disk: the kernel is told which chunk files come next.

A load reads each chunk's file with one ``preadv`` on a few readers (cores + 1: warm, a read is
CPU work). From a disk, the page cache empty (chunks are written past it, ``cas.blobstore.direct``;
a node after a reboot), each of those reads waits for its own megabytes, so the device sees a
handful of requests at a time and runs well below its speed. Told ahead
(``posix_fadvise(WILLNEED)``), the kernel queues the reads of the next files at once and the
readers find them cached: a cold load of the 1 GiB state took 1.30 s, and 0.81 s with every file
advised first (docs/design.md). A file already in the page cache is left alone, since the advice
walks every cached page (15 ms of CPU per GiB, a tenth of a warm load): a non-blocking read of
its last page (``RWF_NOWAIT``) says whether it is there.

Where cold chunk files are read past the page cache (``cas.blobstore.direct.read_cold``: Linux
6.5 and on, unless ``CAS_DIRECT_READS=0``), no advice is given: it would fill the page cache
those reads keep out of.

The advice runs on a thread of its own, at most ``window`` bytes ahead of what the readers have
read, so a load much larger than the page cache does not evict what it is about to read. It only
ever advises; every byte is still read and checked by the readers.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MIN_BYTES", "WARM_RUN", "WINDOW", "ReadAhead"]

MIN_BYTES = 64 << 20
"""Loads smaller than this get no read-ahead thread: starting one costs more than it saves."""
WINDOW = 256 << 20
"""How far ahead of the readers the advice runs."""
WARM_RUN = 8
"""Files in a row found cached after which the load is taken as warm and the advice ends: asking
of every file cost a warm 1 GiB load about a tenth of its time (0.21 s against 0.19 s)."""
_PROBE = 4096


class ReadAhead:
    """Advises the files ``paths`` (of ``sizes`` bytes each) in order, ``window`` bytes ahead of
    the progress reported by ``advance``, on a thread of its own until ``stop``."""

    def __init__(self, paths: Sequence[Path], sizes: Sequence[int], window: int = WINDOW) -> None:
        self.paths = list(paths)
        self.sizes = list(sizes)
        self.window = window
        self.advised: list[Path] = []
        """The files found cold and advised, in order (for tests and reports)."""
        self._done = 0
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="cas-readahead", daemon=True)

    def start(self) -> ReadAhead:
        self._thread.start()
        return self

    def advance(self, nbytes: int) -> None:
        """The readers have read ``nbytes`` more."""
        with self._cond:
            self._done += nbytes
            self._cond.notify()

    def stop(self) -> None:
        """End the advice (the load is over, or failed) and wait for the thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        ahead = 0
        cached = 0
        for path, size in zip(self.paths, self.sizes, strict=True):
            with self._cond:
                while not self._stopped and ahead - self._done >= self.window:
                    self._cond.wait()
                if self._stopped:
                    return
            if advise_if_cold(path):
                self.advised.append(path)
                cached = 0
            else:
                cached += 1
                if cached >= WARM_RUN:
                    return  # a warm load: its readers need the cores more than this thread
            ahead += size


def advise_if_cold(path: Path) -> bool:
    """Ask the kernel to read ``path`` into the page cache unless its last page is there
    already; whether it asked. Any error is left for the reader of the file to meet."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size and _cached(fd, (size - 1) // _PROBE * _PROBE):
            return False
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _cached(fd: int, offset: int) -> bool:
    """Whether the page of ``fd`` at ``offset`` is in the page cache (a read that may not wait
    for the disk succeeds); False where the kernel cannot say."""
    try:
        return os.preadv(fd, [bytearray(_PROBE)], offset, os.RWF_NOWAIT) > 0
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return False


def usable() -> bool:
    """Whether this platform can advise and probe (Linux)."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "RWF_NOWAIT")
