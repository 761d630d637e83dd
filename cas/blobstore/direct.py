"""Direct I/O for large local writes: bytes go from an aligned buffer to the disk, not the page cache.

A buffered write copies every byte into the page cache and grows it by a checkpoint's size each
save; the kernel then writes it back. On a 2-core machine that runs training on both cores, this
kernel work is what a background save costs the loop. Measured on a 25 MB AdamW state saved every
50 steps (``scripts/bench_manager.py``, batch 64), the loop lost 13-19% to buffered writes and
6-9% to direct ones; one 25 MB write cost 7-52 ms of system CPU buffered against 5-6 ms direct
(docs/design.md).

``O_DIRECT`` wants the memory address, the file offset and the length aligned to the device's
block size, so the parts are copied into a reused page-aligned buffer, zero-padded to a multiple of
``ALIGN`` and written whole, and the file is then truncated to its real length. Filesystems that
refuse ``O_DIRECT`` (tmpfs on older kernels, some network and FUSE filesystems) raise
``DirectIOUnsupported`` and the caller falls back to buffered writes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence

import numpy as np

ALIGN = 4096
"""Covers 512-byte and 4 KiB logical blocks, and the page size ``O_DIRECT`` asks of most filesystems."""
DIRECT_MIN = 1 << 20
"""Smaller writes stay buffered: they are manifests and refs, and a copy to align them costs more
than the page cache does."""
DIRECT_MAX = 64 << 20
"""Larger writes stay buffered too, so no thread keeps an aligned buffer bigger than this."""
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class DirectIOUnsupported(OSError):
    """This filesystem refuses ``O_DIRECT``; write through the page cache instead."""


class AlignedBuffers:
    """One page-aligned anonymous mapping per thread, grown on demand and reused.

    Reuse matters as much as alignment: a fresh mapping costs a page fault for every 4 KiB page it
    is written through, which is the cost direct I/O is meant to save.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes for the calling thread."""
        buffer: mmap.mmap | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            if buffer is not None:
                buffer.close()
            buffer = mmap.mmap(-1, _aligned(size))
            self._local.buffer = buffer
        return buffer


def wants_direct(total: int) -> bool:
    """Whether a write of ``total`` bytes should bypass the page cache on this platform."""
    return bool(O_DIRECT) and DIRECT_MIN <= total <= DIRECT_MAX


def write_direct(
    path: os.PathLike[str] | str,
    parts: Sequence[bytes | bytearray | memoryview],
    total: int,
    buffers: AlignedBuffers,
    *,
    fsync: bool,
) -> None:
    """Create ``path`` (it must not exist) holding ``parts`` in order, written with ``O_DIRECT``.

    Raises DirectIOUnsupported, leaving no file behind, when the filesystem refuses direct I/O;
    any other OSError also leaves no file.
    """
    padded = _aligned(total)
    # numpy copies with the GIL released; a memoryview slice assignment holds it for the whole
    # copy, which stalls a training loop's Python between its ops.
    aligned = np.frombuffer(buffers.get(padded), dtype=np.uint8, count=padded)
    at = 0
    for part in parts:
        data = np.frombuffer(part, dtype=np.uint8)
        aligned[at : at + len(data)] = data
        at += len(data)
    aligned[at:padded] = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectIOUnsupported(e.errno, f"{path}: O_DIRECT refused") from e
        raise
    try:
        written = 0
        while written < padded:
            written += os.write(fd, aligned.data[written:padded])
        os.ftruncate(fd, total)
        if fsync:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        os.unlink(path)
        if isinstance(e, OSError) and e.errno == errno.EINVAL:
            raise DirectIOUnsupported(e.errno, f"{path}: O_DIRECT write refused") from e
        raise
    os.close(fd)


def _aligned(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)
