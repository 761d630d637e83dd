"""Direct I/O for large local writes: bytes go from user memory to the disk, not the page cache.

A buffered write copies every byte into the page cache and grows it by a checkpoint's size each
save; the kernel then writes it back. On a 2-core machine that runs training on both cores, this
kernel work is what a background save costs the loop. Measured on a 25 MB AdamW state saved every
50 steps (``scripts/bench_manager.py``, batch 64), the loop lost 13-19% to buffered writes and
6-9% to direct ones; one 25 MB write cost 7-52 ms of system CPU buffered against 5-6 ms direct
(docs/design.md).

``O_DIRECT`` wants every memory address, file offset and length aligned to the device's block
size. A blob is written in ``ALIGN``-sized blocks, by one ``pwritev`` as a rule: a block lying
wholly inside a part whose address is congruent to its file offset modulo ``ALIGN`` goes to the
disk from where it lies; the others (a chunk's header with the head of its payload, the tail, any
incongruent part) are assembled in a reused page-aligned buffer, the last one zero-padded, and the
file is then truncated to its real length. A 4 MiB chunk cost 0.35-0.46 ms of CPU copied whole and
0.23-0.35 ms written in place, so ``cas.training.async_save`` stages tensors where their chunks are
congruent. Filesystems that refuse ``O_DIRECT`` (tmpfs on older kernels, some network and FUSE
filesystems) raise ``DirectIOUnsupported`` and the caller falls back to buffered writes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

Staging = Callable[[int], AbstractContextManager[Any]]
"""Leases a page-aligned writable uint8 array of at least the bytes asked, rounded up to whole
pages, or None when none is free (``StagingPool.lease_pages`` of ``cas.objects.staging``)."""

ALIGN = 4096
"""Covers 512-byte and 4 KiB logical blocks, and the page size ``O_DIRECT`` asks of most filesystems."""
DIRECT_MIN = 1 << 20
"""Smaller writes stay buffered: they are manifests and refs, and a copy to align them costs more
than the page cache does."""
DIRECT_MAX = 64 << 20
"""Larger writes stay buffered too, so no thread keeps an aligned buffer bigger than this."""
HEAD_CACHED = 16 << 10
"""The head of a directly written blob is read back into the page cache once written: the next
save asks of every chunk it reuses whether it is stored and sound by reading its first 16 KiB
(``HEAD_READ`` of ``cas.objects.store``), and from the disk those reads cost a re-save of the
1 GiB state 20 ms (0.131-0.144 s against 0.153-0.165 s)."""
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
IOV_MAX: int = os.sysconf("SC_IOV_MAX") if O_DIRECT else 0
"""Buffers one ``pwritev`` takes; a write with more is split across calls. Asked only where
``O_DIRECT`` exists, as not every platform has ``sysconf``."""


HUGE = 2 << 20
"""A transparent huge page: staging buffers start on this boundary."""
_MADV_POPULATE_WRITE = 23
"""Linux 5.14's advice to fault a range in, writable, in one call (not named by ``mmap`` before
Python 3.13); older kernels refuse it and the range is written through instead."""


READ_MAX = (16 << 20) + ALIGN
"""Cold reads past the page cache go up to a 16 MiB chunk with its header; a larger one is read
through the page cache, so no read leases more of the staging pool than this."""
COLD_SHARE = 1 / 8
"""A file with no more than this share of its pages cached is read past the page cache. A
direct write leaves a chunk's head (``HEAD_CACHED``) and its last page cached: five of 1,025."""
READ_ONCE_LIMIT = 1 << 16
"""Files read past the page cache that a process remembers (``_read_before``): 256 GiB of 4 MiB
chunks, in about 6 MiB of memory."""
_read_once: set[tuple[int, int]] = set()
_once_lock = threading.Lock()
_CACHESTAT = 451
"""Linux 6.5's ``cachestat`` (the same number on x86-64 and arm64)."""
ENV_READS = "CAS_DIRECT_READS"
"""``0`` reads every chunk file through the page cache (many processes on one node loading one
checkpoint at once: the first one's reads then serve the rest)."""
_cold_reads: bool | None = None
"""Whether a cold chunk file is read past the page cache: asked of ``ENV_READS`` when first
needed; off once the kernel cannot say what is cached, or a filesystem refused ``O_DIRECT``."""


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


def huge_page_region(size: int, *, populate: bool = False) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping and the offset in it of ``size`` bytes that start on a 2 MiB
    boundary and are advised for transparent huge pages (faulted in now if ``populate``). The
    mapping is larger by up to 2 MiB of address space that is never touched, so it costs no
    memory. The staging pool's buffers (``cas.objects.staging``) are made so, and so are the
    sealed stores' write buffers."""
    import numpy as np

    mapping = mmap.mmap(-1, size + HUGE - ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -np.frombuffer(mapping, dtype=np.uint8).ctypes.data % HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    if populate:
        try:
            mapping.madvise(_MADV_POPULATE_WRITE, start, size)
        except OSError:
            np.frombuffer(mapping, dtype=np.uint8)[start : start + size : ALIGN] = 0
    return mapping, start


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

    The parts must stay unchanged until this returns: congruent ones are read by the disk write.
    Raises DirectIOUnsupported, leaving no file behind, when the filesystem refuses direct I/O;
    any other OSError also leaves no file.
    """
    views = [memoryview(part).cast("B") for part in parts]
    iovecs = _gather(views, total, buffers)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectIOUnsupported(e.errno, f"{path}: O_DIRECT refused") from e
        raise
    try:
        _write_all(fd, iovecs)
        os.ftruncate(fd, total)
        if fsync:
            os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, min(total, HEAD_CACHED), os.POSIX_FADV_WILLNEED)
    except BaseException as e:
        os.close(fd)
        os.unlink(path)
        if isinstance(e, OSError) and e.errno == errno.EINVAL:
            raise DirectIOUnsupported(e.errno, f"{path}: O_DIRECT write refused") from e
        raise
    os.close(fd)


@dataclass(frozen=True)
class _Run:
    """Whole blocks ``[start, end)`` of the file, written from ``source`` where it lies or, when
    there is none, assembled in the scratch buffer."""

    start: int
    end: int
    source: memoryview | None = None


def _gather(parts: Sequence[memoryview], total: int, buffers: AlignedBuffers) -> list[memoryview]:
    """The buffers to write, in file order: in-place runs, and scratch runs filled here."""
    runs = _runs(parts, total)
    scratch_size = sum(run.end - run.start for run in runs if run.source is None)
    scratch = buffers.get(scratch_size)
    # numpy copies with the GIL released; a memoryview slice assignment holds it for the whole
    # copy, which stalls a training loop's Python between its ops.
    import numpy as np  # here, not at the top: ``import cas`` stays quick

    block = np.frombuffer(scratch, dtype=np.uint8, count=scratch_size)
    iovecs = []
    at = 0
    for run in runs:
        if run.source is not None:
            iovecs.append(run.source)
            continue
        size = run.end - run.start
        _fill(block[at : at + size], parts, run.start)
        iovecs.append(memoryview(scratch)[at : at + size])
        at += size
    return iovecs


def _runs(parts: Sequence[memoryview], total: int) -> list[_Run]:
    """The file, ``total`` bytes padded to ``ALIGN``, cut into in-place and scratch runs."""
    runs = []
    at = 0
    for run in _in_place_runs(parts):
        if run.start > at:
            runs.append(_Run(at, run.start))
        runs.append(run)
        at = run.end
    if at < _aligned(total):
        runs.append(_Run(at, _aligned(total)))
    return runs


def _in_place_runs(parts: Sequence[memoryview]) -> list[_Run]:
    """The whole blocks of each part that sits, modulo ``ALIGN``, where it goes in the file."""
    runs = []
    offset = 0
    for part in parts:
        if part.nbytes and (_address(part) - offset) % ALIGN == 0:
            start = -(-offset // ALIGN) * ALIGN
            end = (offset + part.nbytes) // ALIGN * ALIGN
            if end > start:
                runs.append(_Run(start, end, part[start - offset : end - offset]))
        offset += part.nbytes
    return runs


def _fill(block: np.ndarray[Any, Any], parts: Sequence[memoryview], start: int) -> None:
    """Copy the file bytes ``[start, start + len(block))`` from ``parts``, zeros past their end."""
    import numpy as np

    end = start + len(block)
    at = start
    offset = 0
    for part in parts:
        lo, hi = max(at, offset), min(end, offset + part.nbytes)
        if lo < hi:
            block[lo - start : hi - start] = np.frombuffer(
                part[lo - offset : hi - offset], np.uint8
            )
            at = hi
        offset += part.nbytes
    block[at - start :] = 0


def _write_all(fd: int, iovecs: Sequence[memoryview]) -> None:
    """``pwritev`` every buffer from file offset 0, going on after a short write."""
    remaining = list(iovecs)
    written = 0
    while remaining:
        done = os.pwritev(fd, remaining[:IOV_MAX], written)
        if done <= 0:
            raise OSError(errno.EIO, "direct write made no progress")
        written += done
        remaining = _after(remaining, done)


def _after(views: Sequence[memoryview], skipped: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``skipped`` bytes are written."""
    for index, view in enumerate(views):
        if skipped < view.nbytes:
            return [view[skipped:], *views[index + 1 :]]
        skipped -= view.nbytes
    return []


def _address(view: memoryview) -> int:
    """Where the view's first byte is in memory."""
    import numpy as np

    address: int = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return address


def _aligned(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


def cold_reads() -> bool:
    """Whether a load reads chunk files that are not in the page cache past it
    (``read_cold``); while it does, kernel read-ahead would only get in its way."""
    global _cold_reads
    if _cold_reads is None:
        machine = os.uname().machine if hasattr(os, "uname") else ""
        wanted = os.environ.get(ENV_READS, "").strip() != "0"
        _cold_reads = wanted and bool(O_DIRECT) and machine in ("x86_64", "aarch64", "arm64")
        if _cold_reads:  # ask once, of this module's own file, whether the kernel can say
            try:
                fd = os.open(__file__, os.O_RDONLY)
            except OSError:
                _cold_reads = False
            else:
                try:
                    _cold_reads = _cached_pages(fd) is not None
                finally:
                    os.close(fd)
    return _cold_reads


def cached_pages(fd: int) -> int | None:
    """How many of ``fd``'s pages are in the page cache (``cachestat``, which reads nothing and
    changes nothing, where a probing read would pull the page in); None where the kernel cannot
    say (``cold_reads`` is then off)."""
    return _cached_pages(fd) if cold_reads() else None


def _cached_pages(fd: int) -> int | None:
    syscall, whole_file, counts_type = _cachestat()
    counts = counts_type()
    if syscall(_CACHESTAT, fd, whole_file, counts, 0) != 0:
        return None  # ENOSYS before Linux 6.5, or a sandbox's EPERM
    return int(counts[0])


@cache
def _cachestat() -> tuple[Any, Any, Any]:
    """``syscall``, a range covering a whole file, and the type of the counts ``cachestat``
    returns (cached, dirty, under writeback, evicted, recently evicted); made once, when first
    asked, so ``import cas`` does not load ctypes."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]

    return ctypes.CDLL(None, use_errno=True).syscall, ctypes.byref(Range(0, 0)), ctypes.c_uint64 * 5


def read_cold(fd: int, outs: Sequence[memoryview], wanted: int, staging: Staging) -> int | None:
    """Read the first ``wanted`` bytes of ``fd`` into ``outs`` past the page cache, when no more
    than ``COLD_SHARE`` of it is cached; how many were read (fewer only at the file's end).
    None, with nothing read, leaves the read to the page cache: more of the file is cached,
    ``wanted`` is not between ``DIRECT_MIN`` and ``READ_MAX``, the kernel cannot say,
    ``staging`` has no buffer free, this process read the file past the cache before
    (``_read_before``), or the filesystem refuses ``O_DIRECT`` (remembered).

    The file lands in an aligned staging buffer (huge pages: a direct read of 4 MiB from 4 KiB
    pages reached a virtio disk as several requests) and is copied out with the GIL released.
    A cold load that read through the page cache faulted in a fresh page-cache page for every
    4 KiB it read, as costly on a VM as the tensors themselves (docs/design.md).
    """
    global _cold_reads
    if not DIRECT_MIN <= wanted <= READ_MAX:
        return None
    cached = cached_pages(fd)
    if cached is None or cached * ALIGN > wanted * COLD_SHARE:
        return None
    import fcntl

    import numpy as np

    with staging(wanted) as buffer:
        if buffer is None or _read_before(fd):
            return None
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
            got = _read_all(fd, memoryview(buffer)[: _aligned(wanted)])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _cold_reads = False
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            return None
        got = min(got, wanted)
        at = 0
        for out in outs:
            n = min(len(out), got - at)
            if n <= 0:
                break
            np.frombuffer(out, dtype=np.uint8, count=n)[:] = buffer[at : at + n]
            at += n
        return got


def _read_before(fd: int) -> bool:
    """Whether this process read ``fd``'s file past the page cache before, and has not since
    read it through the cache; it is remembered either way. A file read once is read past the
    page cache, one read again goes through it, so the reads after find it there: a resume reads
    a checkpoint once, a process that loads one twice will likely load it again (the page
    cache's own rule for what to keep: a page touched twice)."""
    stat = os.fstat(fd)
    file = (stat.st_dev, stat.st_ino)
    with _once_lock:
        if file in _read_once:
            _read_once.discard(file)
            return True
        if len(_read_once) >= READ_ONCE_LIMIT:
            _read_once.clear()  # forgetting costs a file one more read past the cache
        _read_once.add(file)
        return False


def _read_all(fd: int, into: memoryview) -> int:
    """``preadv`` into ``into`` from offset 0 until it is full or the file ends."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], done)
        done += n
        if not n or n % ALIGN:
            break  # the file's end: a direct read there is short, and unaligned after it
    return done
