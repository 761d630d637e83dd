"""A load's chunk reads run on a few long-lived tasks pulling from one feed, the caller among them.

Loading a checkpoint of many small chunks on 2 cores ran no faster with three readers than with
one while each chunk was its own pool task (the caller woke per chunk to queue the next). Now
``readers`` tasks, the calling thread included, pull chunks off one shared feed. What must hold:
reads still overlap, a duplicate chunk is still read once, the first failure is still raised
after the reads under way settle, and a read started from a pool thread finishes even when the
pool has no free thread.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from cas.blobstore import LocalBlobStore, MemoryBlobStore
from cas.blobstore.base import BlobStore
from cas.codecs import EncodeHints, codec_by_name
from cas.digest import Digest
from cas.errors import FormatError, IntegrityError
from cas.model.manifest import ChunkRef
from cas.objects.chunking import Cut
from cas.objects.chunkio import ChunkIO, WriteStats
from cas.objects.store import ObjectStore, chunk_key

CHUNK = 256 << 10
"""Eight of these make a read of 2 MiB: helpers join a read of a megabyte or more each."""


def _stored(
    tmp_path: Path,
    chunks: int,
    workers: int = 4,
    readers: int = 2,
    size: int = CHUNK,
    blobs: BlobStore | None = None,
) -> tuple[ChunkIO, bytes, list[ChunkRef]]:
    """``chunks`` distinct raw chunks of ``size`` bytes written through a ChunkIO with
    ``readers`` readers, on ``blobs`` (default: a local store under ``tmp_path``)."""
    data = np.random.default_rng(1).integers(0, 256, chunks * size, dtype=np.uint8).tobytes()
    store = blobs if blobs is not None else LocalBlobStore(tmp_path / "store")
    io = ChunkIO(ObjectStore(store), workers, readers=readers)
    cuts = [Cut(i * size, size) for i in range(chunks)]
    futures = io.write_cuts(
        memoryview(data), cuts, codec_by_name("raw"), EncodeHints(), WriteStats()
    )
    return io, data, [f.result() for f in futures]


def _first_two_meet() -> Callable[[Digest], None]:
    """A ``before`` for ``_watch`` where each of the first two reads waits for the other: reads
    made one at a time break the barrier (timeout) instead of passing it."""
    barrier = threading.Barrier(2, timeout=20)
    started = iter(range(10**6))

    def meet(_: Digest) -> None:
        if next(started) < 2:
            barrier.wait()

    return meet


def _watch(
    io: ChunkIO, before: Callable[[Digest], None] | None = None
) -> Counter[tuple[Digest, int]]:
    """Count reads per (chunk, thread); ``before(digest)`` runs ahead of each read."""
    seen: Counter[tuple[Digest, int]] = Counter()
    lock = threading.Lock()
    real = io.objects.read_chunk_into

    def read(digest: Digest, out: memoryview, *, encoded: bool = False) -> None:
        with lock:
            seen[(digest, threading.get_ident())] += 1
        if before is not None:
            before(digest)
        real(digest, out, encoded=encoded)

    io.objects.read_chunk_into = read  # type: ignore[method-assign]
    return seen


def test_reads_overlap_on_the_caller_and_a_helper(tmp_path: Path) -> None:
    io, data, refs = _stored(tmp_path, 8, readers=2)
    seen = _watch(io, _first_two_meet())
    out = bytearray(len(data))
    io.read_all([(refs, memoryview(out))])
    assert bytes(out) == data
    assert sum(seen.values()) == len(refs)  # every chunk read once
    assert threading.get_ident() in {thread for _, thread in seen}  # the caller read too
    assert len({thread for _, thread in seen}) == 2
    io.close()


def test_a_chunk_named_in_many_places_is_read_once(tmp_path: Path) -> None:
    io, data, refs = _stored(tmp_path, 8, readers=3)
    seen = _watch(io)
    listing = [refs[0], refs[1], refs[0], refs[2], refs[0]]
    out, other = bytearray(5 * CHUNK), bytearray(2 * CHUNK)
    io.read_all([(listing, memoryview(out)), ([refs[2], refs[0]], memoryview(other))])
    parts = [data[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    assert bytes(out) == parts[0] + parts[1] + parts[0] + parts[2] + parts[0]
    assert bytes(other) == parts[2] + parts[0]
    assert Counter(digest for digest, _ in seen.elements()) == {r.digest: 1 for r in refs[:3]}
    io.close()


def test_a_bad_chunk_is_raised_after_the_reads_under_way_settle(tmp_path: Path) -> None:
    io, data, refs = _stored(tmp_path, 12, readers=3)
    path = tmp_path / "store" / chunk_key(refs[5].digest)
    body = bytearray(path.read_bytes())
    body[-1] ^= 0xFF
    path.write_bytes(bytes(body))
    running = threading.Semaphore(0)
    settled: list[Digest] = []
    real = io.objects.read_chunk_into

    def read(digest: Digest, out: memoryview, *, encoded: bool = False) -> None:
        running.release()
        try:
            real(digest, out, encoded=encoded)
        finally:
            settled.append(digest)

    io.objects.read_chunk_into = read  # type: ignore[method-assign]
    with pytest.raises(IntegrityError, match=str(refs[5].digest)):
        io.read_all([(refs, memoryview(bytearray(len(data))))])
    started = 0
    while running.acquire(blocking=False):
        started += 1
    assert started == len(settled)  # nothing still reading when the error surfaced
    assert refs[5].digest in settled
    io.close()


def test_a_manifest_listing_one_chunk_at_two_sizes_is_a_format_error(tmp_path: Path) -> None:
    io, _, refs = _stored(tmp_path, 2, readers=2)
    liar = ChunkRef(refs[0].digest, CHUNK // 2)
    with pytest.raises(FormatError, match="listed as"):
        io.read_all([([refs[0], refs[1], liar], memoryview(bytearray(2 * CHUNK + CHUNK // 2)))])
    io.close()


def test_a_read_started_from_a_busy_pool_thread_finishes(tmp_path: Path) -> None:
    """With every pool thread taken (here by the caller itself), the caller reads alone."""
    io, data, refs = _stored(tmp_path, 12, workers=1, readers=3)
    out = bytearray(len(data))
    seen = _watch(io)
    done = io.submit(io.read_all, [(refs, memoryview(out))])
    done.result(timeout=30)  # the helpers it queued are behind it: it must not wait for them
    assert bytes(out) == data
    assert len({thread for _, thread in seen}) == 1
    io.close()


def test_concurrent_loads_share_the_reader_slots(tmp_path: Path) -> None:
    io, data, refs = _stored(tmp_path, 12, readers=2)
    active, peak = 0, 0
    lock = threading.Lock()
    real = io.objects.read_chunk_into

    def read(digest: Digest, out: memoryview, *, encoded: bool = False) -> None:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            real(digest, out, encoded=encoded)
        finally:
            with lock:
                active -= 1

    io.objects.read_chunk_into = read  # type: ignore[method-assign]
    outs = [bytearray(len(data)) for _ in range(4)]
    with ThreadPoolExecutor(4) as callers:
        list(callers.map(lambda out: io.read_all([(refs, memoryview(out))]), outs))
    assert all(bytes(out) == data for out in outs)
    assert peak <= 2  # readers bound the reads at once across every caller
    io.close()


def test_a_read_under_a_megabyte_stays_on_the_caller(tmp_path: Path) -> None:
    """Waking a helper for a tiny checkpoint costs more than the reading it would share."""
    io, data, refs = _stored(tmp_path, 3, readers=3)
    seen = _watch(io)
    out = bytearray(len(data))
    io.read_all([(refs, memoryview(out))])
    assert bytes(out) == data
    assert {thread for _, thread in seen} == {threading.get_ident()}
    io.close()


def test_a_blob_longer_than_one_read_returns_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux returns at most ~2 GiB per read; a larger blob is gathered over several (shown
    here with the cap lowered to 4 KiB), and a short read below the cap is the blob's end."""
    import cas.blobstore.local as local

    store = LocalBlobStore(tmp_path / "store")
    blob = np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    store.put("blobs/big", blob)
    real = os.pread
    calls: list[int] = []

    def capped(fd: int, length: int, offset: int) -> bytes:
        calls.append(length)
        return real(fd, min(length, 4096), offset)

    monkeypatch.setattr(local, "_MAX_READ", 4096)
    monkeypatch.setattr(os, "pread", capped)
    assert store.get("blobs/big") == blob
    assert len(calls) == 3
    calls.clear()
    assert store.get_range("blobs/big", 9_000, 20_000) == blob[9_000:]  # past the end: its end
    assert calls == [11_000]
    assert store.get_range("blobs/big", 100, 8_300) == blob[100:8_300]


def test_a_small_read_from_a_remote_store_still_overlaps(tmp_path: Path) -> None:
    """A remote read waits on the network, not the CPU: a few kilobytes of chunks still get
    helpers (shown on an in-memory store, which does not read in place)."""
    io, data, refs = _stored(tmp_path, 8, readers=2, size=4096, blobs=MemoryBlobStore())
    seen = _watch(io, _first_two_meet())
    out = bytearray(len(data))
    io.read_all([(refs, memoryview(out))])
    assert bytes(out) == data
    assert len({thread for _, thread in seen}) == 2
    io.close()
