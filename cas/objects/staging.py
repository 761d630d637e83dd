"""The staging pool: page-aligned buffers allocated once per process and reused by every save.

A new chunk is copied once into private memory before it is hashed and written (invariant 9).
Where that memory comes from decides what a full save costs: on a VM that hands freed pages
back to its host, a copy into a fresh allocation faults in every 4 KiB page and ran at 0.39 GiB/s,
a copy into a buffer that already exists at 11.3 GiB/s. So the private copies live in a pool of
buffers that outlives saves, store handles and managers: the second save of a process, and every
one after it, copies into warm memory. The pool's buffers are laid out for ``O_DIRECT`` (a
chunk's payload sits where it goes in its file, modulo a page), so the disk write sends them
from where they lie and the page cache never sees a new chunk (``cas.blobstore.direct``).

The pool is bounded: ``CAS_STAGING_POOL`` (a size such as ``256M``; default 64 MiB, which holds
the largest chunk a store may have) is all the memory it ever holds, and a lease that would pass
it waits for another to be returned. A save's extra memory is therefore the pool, whatever the
checkpoint's size. Each buffer starts on a 2 MiB boundary and asks for transparent huge pages
(``MADV_HUGEPAGE``), then is faulted in at once, once per process. Huge pages matter to the disk,
not only to the copy: a direct write is cut into requests of at most ``max_segments`` physically
contiguous runs, so a 4 MiB chunk in 4 KiB pages reaches a virtio disk as several requests and
in 2 MiB pages as one. On this project's 2-core VM, 1 GiB written as 4 MiB chunk files by eight
threads took 0.62 s from 4 KiB pages and 0.51 s from huge ones (docs/design.md).

A leased buffer is private (``cas.objects.private.is_private``) only while its lease lasts: no
view of it may outlive the ``with`` block, since the next lease reuses the memory. The object
layer's chunk door (``ObjectStore.put_chunk``) and the readers of input files are its users.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from cas.blobstore.direct import huge_page_region as huge_page_region
from cas.errors import CASError
from cas.objects.private import PAYLOAD_OFFSET, private_copy_class
from cas.units import format_size, parse_size

ENV = "CAS_STAGING_POOL"
DEFAULT_BYTES = 64 << 20
"""Sixteen 4 MiB chunks (the default chunk size) in flight, or one of the largest (64 MiB)."""
_PAGE = 4096
_MIN = 1 << 20


class StagingPool:
    """A bounded set of reusable page-aligned buffers, leased one chunk at a time."""

    def __init__(self, limit: int = DEFAULT_BYTES) -> None:
        if limit < _MIN:
            raise CASError(f"staging pool of {format_size(limit)} is below 1 MiB")
        self.limit = limit
        self._free: list[_Buffer] = []
        self._held = 0
        """Bytes of every buffer the pool owns, leased or free."""
        self.peak = 0
        """The most ``_held`` has been: what the pool has cost this process at most."""
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes the pool holds now, leased or free."""
        return self._held

    @contextmanager
    def lease(self, nbytes: int) -> Iterator[Any]:
        """A writable uint8 array of ``nbytes`` from the pool, for the ``with`` block only.

        The array starts ``PAYLOAD_OFFSET`` bytes past a page boundary, where a chunk's payload
        lies in its file. A request larger than the whole pool gets a buffer of its own, freed
        after the block (the pool's bound is on what it keeps, and such chunks cannot be stored
        any other way).
        """
        need = _capacity(nbytes)
        buffer = self._take(need)
        assert buffer is not None  # a lease that may wait always gets one
        try:
            yield _array(buffer, nbytes)
        finally:
            self._give(buffer)

    @contextmanager
    def lease_pages(self, nbytes: int) -> Iterator[Any]:
        """A writable uint8 array of ``nbytes`` rounded up to whole pages, starting on a page
        (and 2 MiB) boundary, for the ``with`` block only; None when the pool has no buffer free
        and no room for one. This lease never waits: a reader that holds one may be a save's
        worker, and every other lease may be held by workers waiting on it. A chunk file read
        past the page cache lands here (``cas.blobstore.direct.read_cold``).
        """
        need = _capacity(nbytes)
        buffer = self._take(need, wait=False) if need <= self.limit else None
        if buffer is None:
            yield None
            return
        try:
            import numpy as np

            whole = np.frombuffer(buffer.mapping, dtype=np.uint8)
            yield whole[buffer.start : buffer.start + -(-nbytes // _PAGE) * _PAGE]
        finally:
            self._give(buffer)

    def _take(self, need: int, *, wait: bool = True) -> _Buffer | None:
        with self._cond:
            while True:
                fits = [buffer for buffer in self._free if buffer.size >= need]
                if fits:
                    buffer = min(fits, key=lambda fit: fit.size)
                    self._free.remove(buffer)
                    return buffer
                if self._held + need <= self.limit or (self._held == 0 and need > self.limit):
                    break
                if self._free:
                    # Too small for this lease, and the bound leaves no room beside them.
                    spare = self._free.pop()
                    self._held -= spare.size
                    _unmap(spare)
                    continue
                if not wait:
                    return None
                self._cond.wait()
            self._held += need
            self.peak = max(self.peak, self._held)
        try:
            return _mapping(need)
        except BaseException:
            with self._cond:
                self._held -= need
                self._cond.notify_all()
            raise

    def _give(self, buffer: _Buffer) -> None:
        with self._cond:
            if self._held > self.limit:
                self._held -= buffer.size
                _unmap(buffer)  # an oversized lease: not kept
            else:
                self._free.append(buffer)
            self._cond.notify_all()

    def trim(self) -> int:
        """Unmap every buffer not leased now; the bytes given back."""
        with self._cond:
            freed = sum(buffer.size for buffer in self._free)
            for buffer in self._free:
                _unmap(buffer)
            self._free.clear()
            self._held -= freed
            return freed


def _capacity(nbytes: int) -> int:
    """The mapping a lease of ``nbytes`` needs: the payload offset plus the bytes, whole pages.
    A smaller lease takes the smallest free buffer that fits, so a tensor's short last chunk
    reuses a full chunk's buffer."""
    return -(-(nbytes + PAYLOAD_OFFSET) // _PAGE) * _PAGE


class _Buffer:
    """``size`` bytes of an anonymous mapping, from ``start``: the first 2 MiB boundary in it."""

    def __init__(self, mapping: mmap.mmap, start: int, size: int) -> None:
        self.mapping = mapping
        self.start = start
        self.size = size


def _mapping(size: int) -> _Buffer:
    """A buffer of ``size`` bytes for the pool, in huge pages where the kernel has them."""
    mapping, start = huge_page_region(size, populate=True)
    return _Buffer(mapping, start, size)


def _unmap(buffer: _Buffer) -> None:
    """Unmap a buffer no lease holds; one whose views linger (in a traceback, say) is left to the
    garbage collector instead."""
    with suppress(BufferError):
        buffer.mapping.close()


def _array(buffer: _Buffer, nbytes: int) -> Any:
    import numpy as np

    whole = np.frombuffer(buffer.mapping, dtype=np.uint8)
    at = buffer.start + PAYLOAD_OFFSET
    return whole[at : at + nbytes].view(private_copy_class())


def cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class _Slots:
    """A semaphore of one slot per core, made anew in a forked child (where a slot another thread
    held at the fork would never be given back)."""

    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        self._slots = threading.BoundedSemaphore(cores())

    def __enter__(self) -> None:
        self._slots.acquire()

    def __exit__(self, *exc: object) -> None:
        self._slots.release()


CPU_SLOTS = _Slots()
"""Chunks copied, hashed or encoded at once in this process: one per core this process may run on.

A chunk worker spends most of a new chunk's time waiting on its write, so a save runs more
workers than cores (``cas.objects.chunkio``); their CPU work takes turns here. With every worker
free to copy and hash at once, the writes in flight dropped whenever several chunks were
prepared together, and a 1 GiB first save took 0.60-0.65 s where one slot per core and twelve
workers took 0.56-0.59 s (docs/design.md)."""

_pool: StagingPool | None = None
_pool_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) starts without the parent's pool: a lease another
    thread held at the fork would never be returned there, nor its lock released."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()
    CPU_SLOTS.renew()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def staging_pool() -> StagingPool:
    """The process's pool, sized by ``CAS_STAGING_POOL`` when it is first used."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = StagingPool(pool_limit())
        return _pool


def pool_limit() -> int:
    """The pool's bound: ``CAS_STAGING_POOL`` if set (CASError if unreadable), else the default."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_BYTES
    try:
        return parse_size(text)
    except (ValueError, CASError) as e:
        raise CASError(f"{ENV}={text!r} is not a size such as 256M") from e
