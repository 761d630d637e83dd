"""Parallel chunk I/O: cut, hash and store buffers as chunks; fetch, verify and reassemble them."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cas.blobstore import direct
from cas.codecs import Codec, EncodeHints
from cas.digest import Digest
from cas.errors import FormatError, IntegrityError
from cas.model.manifest import ChunkRef
from cas.objects import readahead
from cas.objects.chunking import Cut
from cas.objects.private import private_view
from cas.objects.store import ObjectStore, PutResult, chunk_key
from cas.threads import LentPool

T = TypeVar("T")

Progress = Callable[[int], None]
"""Called with a number of bytes just processed (for progress bars)."""


@dataclass
class WriteStats:
    """What a write did: logical bytes in, chunks and stored bytes newly written, chunks reused."""

    logical_bytes: int = 0
    new_chunks: int = 0
    new_bytes: int = 0
    reused_chunks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, result: PutResult) -> None:
        """Count one stored chunk."""
        with self._lock:
            self.logical_bytes += result.size
            if result.new:
                self.new_chunks += 1
                self.new_bytes += result.stored_bytes
            else:
                self.reused_chunks += 1

    def as_dict(self) -> dict[str, int]:
        """Plain numbers for ``--json``."""
        return {
            "logical_bytes": self.logical_bytes,
            "new_chunks": self.new_chunks,
            "new_bytes": self.new_bytes,
            "reused_chunks": self.reused_chunks,
        }


WORKERS = 12
"""Chunk workers of a store handle. A new chunk's worker waits on its write most of the time, so
there are more workers than cores, and their CPU work takes turns (``CPU_SLOTS`` of
``cas.objects.staging``): twelve kept the disk busier than eight (a 1 GiB first save 0.59-0.62 s
against 0.61-0.63 s); sixteen gained nothing more, the staging pool holding fifteen chunks."""


class ChunkIO:
    """Runs chunk puts and gets on a shared thread pool (blake3, zstd and file I/O drop the GIL)."""

    def __init__(
        self, objects: ObjectStore, workers: int = WORKERS, readers: int | None = None
    ) -> None:
        self.objects = objects
        self.workers = workers
        self.readers = readers or workers
        self._read_slots = threading.BoundedSemaphore(self.readers)
        """Verified reads running at once: writes wait on fsync and want every worker, while a
        read from a local disk is CPU work (copy, hash, decode) that more threads than cores only
        slow down."""
        self._pool: LentPool | None = None
        self._pool_lock = threading.Lock()

    @property
    def pool(self) -> LentPool:
        """The pool, lent when first asked for (threads a closed handle gave back, or new)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = LentPool(self.workers, "cas-chunk")
            return self._pool

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the pool."""
        return self.pool.submit(fn, *args)

    def read_chunk_into(self, digest: Digest, out: memoryview) -> None:
        """Fill ``out`` (exactly the chunk's size) with the verified chunk bytes."""
        self.objects.read_chunk_into(digest, out)

    def read_chunk_parts(self, digest: Digest, outs: Sequence[memoryview]) -> None:
        """Scatter the verified chunk bytes over ``outs`` (their sizes sum to the chunk's)."""
        self.objects.read_chunk_parts(digest, outs)

    def write_cuts(
        self,
        data: memoryview,
        cuts: Sequence[Cut],
        codec: Codec,
        hints: Sequence[EncodeHints] | EncodeHints,
        stats: WriteStats,
        progress: Progress | None = None,
    ) -> list[Future[ChunkRef]]:
        """Submit one put per cut of ``data``; the futures resolve to ChunkRefs in cut order.

        The ChunkRefs carry no base chain, so every chunk is left standalone: a delta codec is
        refused, and an existing chunk stored as a delta is re-encoded with ``codec`` (same
        identity) so a manifest listing only these refs is complete for GC. Writers that record
        base chains use ``cas.objects.encoding`` instead.
        """
        if codec.needs_base:
            raise ValueError(f"write_cuts cannot record delta bases; {codec.name} needs one")

        def put_one(cut: Cut, hint: EncodeHints) -> ChunkRef:
            # One private reading serves both puts, so a rewrite stores the bytes just named.
            view = private_view(data[cut.offset : cut.offset + cut.size])
            result = self.objects.put_chunk(view, codec, hint)
            if result.base is not None:
                result = self.objects.put_chunk(
                    view, codec, hint, expected=result.digest, replace=True
                )
            stats.add(result)
            if progress is not None:
                progress(cut.size)
            return ChunkRef(result.digest, result.size)

        per_cut = [hints] * len(cuts) if isinstance(hints, EncodeHints) else list(hints)
        return [
            self.pool.submit(put_one, cut, hint) for cut, hint in zip(cuts, per_cut, strict=False)
        ]

    def read_all(
        self,
        jobs: Sequence[tuple[Sequence[ChunkRef], memoryview]],
        progress: Progress | None = None,
        *,
        encoded: AbstractSet[int] = frozenset(),
    ) -> None:
        """Fill each job's ``out`` with its chunks laid end to end, verified; raise the first
        failure once every read started has settled.

        However many chunks a manifest lists, the work queued stays bounded: ``readers`` tasks
        (the calling thread and ``readers - 1`` on the pool) pull chunks off one feed, and a chunk
        named more than once (a run of zeros, or a hostile manifest naming one chunk a million
        times) is read once, then copied to its other places. Beyond the buffers it fills, a read
        holds one entry per distinct chunk.
        ``encoded`` are the jobs whose chunks are likely stored encoded (their tensor was written
        with a codec): each is read whole and decoded straight into place.
        """
        first: dict[Digest, tuple[int, int, int]] = {}
        """Where each distinct chunk is read to: job, offset, size."""
        errors: list[BaseException] = []

        def distinct() -> Iterator[tuple[ChunkRef, memoryview, bool]]:
            for index, (chunks, out) in enumerate(jobs):
                offset = 0
                for ref in chunks:
                    place = first.setdefault(ref.digest, (index, offset, ref.size))
                    if place[2] != ref.size:
                        raise FormatError(
                            f"corrupt manifest: chunk {ref.digest} is listed as {place[2]} and "
                            f"{ref.size} bytes"
                        )
                    if place[:2] == (index, offset):
                        yield ref, out[offset : offset + ref.size], index in encoded
                    offset += ref.size

        feed = distinct()
        feed_lock = threading.Lock()
        ahead = self._read_ahead(jobs)

        def drain() -> None:
            """Read chunks off the shared feed until it is empty or a read failed."""
            try:
                while not errors:
                    with feed_lock:
                        item = next(feed, None)
                    if item is None:
                        return
                    ref, part, hint = item
                    with self._read_slots:
                        self.objects.read_chunk_into(ref.digest, part, encoded=hint)
                    if ahead is not None:
                        ahead.advance(ref.size)
                    if progress is not None:
                        progress(ref.size)
            except BaseException as e:
                errors.append(e)

        # A few long-lived tasks pull chunks off one feed, the calling thread among them: no
        # future, queue hop or wake-up of the caller per chunk (with one task per chunk, a 13 MB
        # GPT checkpoint of 57 chunks loaded no faster on 2 cores than on one), and a call made
        # from a pool thread still finishes with the pool busy.
        # From a local disk a read is CPU work, and a helper is worth waking for a megabyte or
        # more: below that (a tiny model's whole checkpoint) the wake-ups cost more than the
        # reading they share. A remote read waits on the network, so every chunk may have one.
        wanted = min(self.readers - 1, sum(len(chunks) for chunks, _ in jobs) - 1)
        if self.objects.blobs.reads_in_place:
            wanted = min(wanted, sum(len(out) for _, out in jobs) >> 20)
        helpers = [self.pool.submit(drain) for _ in range(max(0, wanted))]
        try:
            drain()
            for helper in helpers:
                # One that never started has nothing left to read (and may be queued behind the
                # caller's own pool task); one that did is waited for. drain records its failure.
                if not helper.cancel():
                    helper.result()
        finally:
            if ahead is not None:
                ahead.stop()
        if errors:
            raise errors[0]
        for index, (chunks, out) in enumerate(jobs):
            offset = 0
            for ref in chunks:
                source, start, size = first[ref.digest]
                if (source, start) != (index, offset):
                    out[offset : offset + size] = jobs[source][1][start : start + size]
                    if progress is not None:
                        progress(size)
                offset += size

    def _read_ahead(
        self, jobs: Sequence[tuple[Sequence[ChunkRef], memoryview]]
    ) -> readahead.ReadAhead | None:
        """Read-ahead of the chunk files a load of ``jobs`` reads, in the readers' order, for a
        load of ``MIN_BYTES`` or more from files on this machine (``cas.objects.readahead``)."""
        blobs = self.objects.blobs
        if blobs.local_root is None or not readahead.usable() or direct.cold_reads():
            return None  # cold files are read past the page cache, which advice would fill
        if sum(len(out) for _, out in jobs) < readahead.MIN_BYTES:
            return None
        seen: set[Digest] = set()
        paths, sizes = [], []
        for chunks, _ in jobs:
            for ref in chunks:
                path = blobs.local_path(chunk_key(ref.digest))
                if ref.digest not in seen and path is not None:
                    seen.add(ref.digest)
                    paths.append(path)
                    sizes.append(ref.size)
        return readahead.ReadAhead(paths, sizes).start()

    def iter_chunks(
        self, chunks: Iterable[ChunkRef], prefetch: int = 16
    ) -> Iterator[bytes | memoryview]:
        """Yield verified chunk bytes in order, fetching up to ``prefetch`` ahead; IntegrityError
        for a chunk whose bytes are not as many as its ``ChunkRef`` says."""

        def get_one(digest: Digest) -> bytes | memoryview:
            with self._read_slots:
                return self.objects.get_chunk(digest)

        def sized(ref: ChunkRef, future: Future[bytes | memoryview]) -> bytes | memoryview:
            # The bytes hash right, but a manifest that lists them with another size would have
            # a reader return more (or less) than the file or tensor it declares.
            data = future.result()
            if len(data) != ref.size:
                raise IntegrityError(
                    f"chunk {ref.digest} has {len(data)} bytes, manifest says {ref.size}"
                )
            return data

        pending: deque[tuple[ChunkRef, Future[bytes | memoryview]]] = deque()
        previous: tuple[Digest, Future[bytes | memoryview]] | None = None
        for ref in chunks:
            # A run of one chunk (zeros, or a hostile list naming it a million times) reads once.
            if previous is None or previous[0] != ref.digest:
                previous = (ref.digest, self.pool.submit(get_one, ref.digest))
            pending.append((ref, previous[1]))
            if len(pending) >= prefetch:
                yield sized(*pending.popleft())
        while pending:
            yield sized(*pending.popleft())

    def close(self) -> None:
        """Wait for the pool's tasks, then give its threads back (``cas.threads``)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for every future; re-raise the first failure after all have settled."""
    error: BaseException | None = None
    for future in futures:
        try:
            future.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
