"""Reading files of checkpoints: verified random access, touching only the chunks a range needs.

``ViewReader`` serves byte ranges of ``FileView``s (``cas.fs.extents``) through the repository's
chunk reader: a chunk a range covers whole is read and verified straight into the caller's
buffer; one it covers in part is fetched whole, verified, and kept in a ``FileReadCache`` (a small
LRU of decoded chunks and chunk tails, distinct from the delta-base cache of the write path in
``cas.objects.chains``) for the next read. ``CASReadFile`` is the fsspec file object on top. A
chunk that fails verification is an I/O error for the reader (``CorruptChunkError``), never wrong
bytes.
"""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from cas.digest import Digest
from cas.errors import IntegrityError, NotFound
from cas.fs.extents import Extent, FileView
from cas.objects.chunkio import wait_all
from cas.repo.core import ChunkReader


class FileReadCache:
    """A small LRU of verified chunks, or of a chunk's tail, bounded in bytes; safe across threads.

    A tail is what a sequential reader has not consumed yet of a chunk its last read ended
    inside. Evicted buffers are reused for the next fetch (a fresh multi-MiB buffer costs page
    faults), which is safe because every copy out of the cache happens under its lock.
    """

    def __init__(self, capacity: int, spare_buffers: int = 8) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Digest, tuple[int, memoryview]] = OrderedDict()
        """digest -> (offset in the chunk of the first byte held, bytes held)"""
        self._spare: list[bytearray] = []
        self._spare_max = spare_buffers
        self._bytes = 0
        self._lock = threading.Lock()

    def copy_into(self, digest: Digest, inner: slice, dst: memoryview) -> bool:
        """Copy ``chunk[inner]`` into ``dst`` if the cache holds those bytes; False if not."""
        with self._lock:
            item = self._items.get(digest)
            if item is None:
                return False
            if not _covers(item, inner):
                return False
            first, data = item
            self._items.move_to_end(digest)
            dst[:] = data[inner.start - first : inner.stop - first]
            return True

    def holds(self, digest: Digest, inner: slice) -> bool:
        """Whether the cache holds bytes ``inner`` of the chunk (they may be evicted by the time
        they are copied; ``copy_into`` says)."""
        with self._lock:
            item = self._items.get(digest)
            return item is not None and _covers(item, inner)

    def contains(self, digest: Digest) -> bool:
        """Whether the whole chunk is cached."""
        with self._lock:
            item = self._items.get(digest)
            return item is not None and item[0] == 0

    def buffer(self, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes to fetch a chunk into, reused when possible."""
        with self._lock:
            for i, spare in enumerate(self._spare):
                if len(spare) >= size:
                    return memoryview(self._spare.pop(i))[:size]
        return memoryview(bytearray(size))

    def put(self, digest: Digest, data: memoryview, first: int = 0) -> None:
        """Remember verified bytes of a chunk from offset ``first`` (a buffer from ``buffer``),
        evicting the least recently used; a whole chunk replaces a tail of it."""
        if len(data) > self.capacity:
            return
        with self._lock:
            held = self._items.get(digest)
            if held is not None:
                if held[0] <= first:
                    return
                self._drop(digest)
            self._items[digest] = (first, data)
            self._bytes += len(data)
            while self._bytes > self.capacity:
                self._drop(next(iter(self._items)))

    def _drop(self, digest: Digest) -> None:
        _, old = self._items.pop(digest)
        self._bytes -= len(old)
        if len(self._spare) < self._spare_max and isinstance(old.obj, bytearray):
            self._spare.append(old.obj)
        old.release()


def _covers(item: tuple[int, memoryview], inner: slice) -> bool:
    """Whether a cache item ``(first, data)`` holds bytes ``inner`` of its chunk."""
    first, data = item
    return bool(first <= inner.start and inner.stop <= first + len(data))


class ViewReader:
    """Reads byte ranges of file views, touching only the chunks a range overlaps.

    A chunk the range covers whole is read and verified straight into the caller's buffer; a
    chunk it covers in part is fetched whole, verified, and kept in the LRU for the next read.
    """

    def __init__(self, chunks: ChunkReader, cache: FileReadCache) -> None:
        self.chunks = chunks
        self.cache = cache
        self._inflight: dict[Digest, Future[None]] = {}
        self._lock = threading.Lock()

    def fetch(self, digest: Digest, size: int) -> None:
        """Make sure a verified copy of the chunk is in the cache."""
        buffer = self.cache.buffer(size)
        self.chunks.read_chunk_into(digest, buffer)
        self.cache.put(digest, buffer)

    def prefetch(self, view: FileView, start: int, end: int) -> None:
        """Start fetching the chunks of ``[start, end)`` into the cache without waiting."""
        for extent in view.touched(start, min(end, view.size)):
            digest = extent.digest
            if digest is None:
                continue
            with self._lock:
                if digest in self._inflight or self.cache.contains(digest):
                    continue
                self._inflight[digest] = self.chunks.submit(
                    self._fetch_tracked, digest, extent.size
                )

    def _fetch_tracked(self, digest: Digest, size: int) -> None:
        try:
            self.fetch(digest, size)
        finally:
            with self._lock:
                self._inflight.pop(digest, None)

    def read_into(self, view: FileView, start: int, out: memoryview, readahead: int = 0) -> int:
        """Fill ``out`` from ``start``; return the bytes read (fewer only at the end of file).

        ``readahead`` bytes past the range are fetched into the cache in the background, so a
        sequential reader finds its next chunks verified already.
        """
        end = min(view.size, start + len(out))
        if start >= end:
            return 0
        work: list[Callable[[], None]] = []
        cached: list[tuple[Extent, slice, memoryview]] = []
        for extent in view.touched(start, end):
            lo, hi = max(start, extent.offset), min(end, extent.offset + extent.size)
            dst = out[lo - start : hi - start]
            inner = slice(lo - extent.offset, hi - extent.offset)
            if extent.data is not None:
                dst[:] = extent.data[inner]
                continue
            assert extent.digest is not None
            if self.cache.holds(extent.digest, inner):
                cached.append((extent, inner, dst))
                continue
            with self._lock:
                pending = self._inflight.get(extent.digest)
            if pending is not None:
                work.append(_after(self, pending, extent, inner, dst))
            elif hi - lo == extent.size:
                work.append(_whole(self.chunks, extent.digest, dst))
            elif lo == extent.offset:
                work.append(_head(self, extent.digest, dst, extent.size))
            else:
                work.append(_part(self, extent, inner, dst))
        if readahead:
            self.prefetch(view, end, end + readahead)
        # Fetches beyond the first go to the pool; this thread copies out of the cache and runs
        # the first fetch meanwhile, so a sequential read keeps both cores busy.
        futures: list[Future[None]] = [self.chunks.submit(task) for task in work[1:]]
        try:
            for extent, inner, dst in cached:
                _copy_out(self, extent, inner, dst)
            if work:
                work[0]()
        finally:
            wait_all(futures)
        return end - start

    def read(self, view: FileView, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the view (clamped to its size)."""
        end = min(end, view.size)
        if start >= end:
            return b""
        buffer = bytearray(end - start)
        self.read_into(view, start, memoryview(buffer))
        return bytes(buffer)


def _whole(chunks: ChunkReader, digest: Digest, dst: memoryview) -> Callable[[], None]:
    return lambda: chunks.read_chunk_into(digest, dst)


def _head(reader: ViewReader, digest: Digest, dst: memoryview, size: int) -> Callable[[], None]:
    """Read a chunk whose head the range covers: the head into the caller's buffer, the tail into
    the cache for the next sequential read, both verified together and copied once."""

    def run() -> None:
        tail = reader.cache.buffer(size - len(dst))
        reader.chunks.read_chunk_parts(digest, [dst, tail])
        reader.cache.put(digest, tail, len(dst))

    return run


def _part(reader: ViewReader, extent: Extent, inner: slice, dst: memoryview) -> Callable[[], None]:
    def run() -> None:
        assert extent.digest is not None
        reader.fetch(extent.digest, extent.size)
        _copy_out(reader, extent, inner, dst)

    return run


def _after(
    reader: ViewReader, pending: Future[None], extent: Extent, inner: slice, dst: memoryview
) -> Callable[[], None]:
    def run() -> None:
        pending.result()  # a failed prefetch fails the read that needs the chunk
        _copy_out(reader, extent, inner, dst)

    return run


def _copy_out(reader: ViewReader, extent: Extent, inner: slice, dst: memoryview) -> None:
    assert extent.digest is not None
    if not reader.cache.copy_into(extent.digest, inner, dst):  # evicted already: a tiny cache
        whole = memoryview(bytearray(extent.size))
        reader.chunks.read_chunk_into(extent.digest, whole)
        dst[:] = whole[inner]


class CorruptChunkError(IntegrityError, OSError):
    """A chunk failed verification while a file was read: an I/O error, never wrong bytes."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)

    def __str__(self) -> str:
        return str(self.args[1])


def read_view(
    reader: ViewReader, view: FileView, start: int, out: memoryview, readahead: int = 0
) -> int:
    """``ViewReader.read_into``, with a corrupt or missing chunk as a ``CorruptChunkError``."""
    try:
        return reader.read_into(view, start, out, readahead)
    except IntegrityError as e:
        raise CorruptChunkError(f"{e} (reading through cas://)") from e
    except NotFound as e:
        raise CorruptChunkError(f"{e}: the store is missing data this file needs") from e


class CASReadFile(AbstractBufferedFile):  # type: ignore[misc]
    """A file opened for reading: random access, each read touching only the chunks it needs.

    ``chunk_size`` is the store's: reads smaller than a chunk read ahead while sequential.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        view: FileView,
        info: dict[str, Any],
        block_size: int | None,
        *,
        reader: ViewReader,
        chunk_size: int,
    ) -> None:
        self.view = view
        self.reader = reader
        self.chunk_size = chunk_size
        self._last_end = -1
        super().__init__(
            fs,
            path,
            mode="rb",
            block_size=block_size or fs.blocksize,
            cache_type="none",
            size=view.size,
        )
        self.details = info

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.view.size)
        if start >= end:
            return b""
        buffer = bytearray(end - start)
        read_view(
            self.reader, self.view, start, memoryview(buffer), self._readahead(start, end - start)
        )
        return bytes(buffer)

    def readinto(self, b: Any) -> int:
        """Read straight into ``b`` (no intermediate copy for whole chunks)."""
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        out = memoryview(b).cast("B")
        count = read_view(
            self.reader, self.view, self.loc, out, self._readahead(self.loc, len(out))
        )
        self.loc += count
        return count

    def _readahead(self, start: int, length: int) -> int:
        """Read ahead while reads are sequential and smaller than a chunk.

        Reads of a chunk or more already fetch their chunks in parallel straight into the
        caller's buffer; staging them through the cache would only add a copy.
        """
        sequential = start == self._last_end
        self._last_end = start + length
        chunk = self.chunk_size
        return 2 * chunk if sequential and start and length < chunk else 0
