"""Cold loads read chunk files past the page cache (``cas.blobstore.direct.read_cold``).

A save writes new chunks with ``O_DIRECT``, so a load right after it, or on a node after a
reboot, finds them on the disk only. Read through the page cache, every 4 KiB of such a load
faulted in a fresh page-cache page beside the tensor's own; read past it into a staging buffer,
the page cache is left as it was. A chunk that is cached is still read from the cache.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest

import cas
from cas.blobstore import direct
from cas.errors import CASError
from cas.objects import readahead
from cas.objects.readahead import ReadAhead
from cas.objects.staging import StagingPool
from cas.repo.config import StoreConfig
from cas.repo.core import default_readers
from tests.helpers import ref_chunk_paths, uncache

MiB = 1 << 20

pytestmark = pytest.mark.skipif(
    not direct.cold_reads(), reason="no O_DIRECT, or no cachestat (Linux 6.5) to tell cold files"
)


def cached(path: Path) -> int:
    """Pages of ``path`` in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = direct.cached_pages(fd)
        assert pages is not None
        return pages
    finally:
        os.close(fd)


def drop(paths: list[Path]) -> None:
    """Take every page of ``paths`` out of the page cache (skip where it cannot be done)."""
    for path in paths:
        uncache(path)
    if any(cached(path) for path in paths):
        pytest.skip("this filesystem keeps a file's pages cached")


def saved(tmp_path: Path) -> tuple[cas.Repository, dict[str, np.ndarray], list[Path]]:
    """A store holding three 2 MiB chunks, none of them cached past its head."""
    repo = cas.open(tmp_path / "store", config=StoreConfig(chunk_size=2 * MiB))
    state = {"w": np.random.default_rng(0).standard_normal(3 * MiB // 4 * 2).astype("f4")}
    repo.save(state, "runs/r1/ckpt")
    paths = ref_chunk_paths(repo, "runs/r1/ckpt")
    assert len(paths) == 3
    return repo, state, paths


@pytest.fixture(autouse=True)
def forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """No file read past the page cache before (an earlier test's inode may be reused)."""
    monkeypatch.setattr(direct, "_read_once", set())


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every read made past the page cache."""
    reads: list[int] = []
    real = direct._read_all

    def counted(fd: int, into: memoryview) -> int:
        got = real(fd, into)
        reads.append(got)
        return got

    monkeypatch.setattr(direct, "_read_all", counted)
    return reads


def test_a_load_right_after_a_save_reads_past_the_page_cache_bit_exact(
    tmp_path: Path, direct_reads: list[int]
) -> None:
    repo, state, paths = saved(tmp_path)

    def mostly_uncached() -> bool:
        return all(cached(path) * 4096 <= path.stat().st_size * direct.COLD_SHARE for path in paths)

    assert mostly_uncached()  # a direct write leaves only its head (read back) cached
    loaded = cas.open(tmp_path / "store").load("runs/r1/ckpt")
    assert np.array_equal(loaded["w"], state["w"])
    assert sorted(direct_reads) == sorted(path.stat().st_size for path in paths)
    assert mostly_uncached()  # the load did not fill the page cache
    repo.close()


def test_a_cached_chunk_is_read_from_the_page_cache(
    tmp_path: Path, direct_reads: list[int]
) -> None:
    repo, state, paths = saved(tmp_path)
    for path in paths:
        path.read_bytes()  # a buffered read: now cached
    loaded = cas.open(tmp_path / "store").load("runs/r1/ckpt")
    assert np.array_equal(loaded["w"], state["w"]) and direct_reads == []
    repo.close()


def test_a_damaged_or_short_cold_chunk_is_caught_not_loaded(tmp_path: Path) -> None:
    repo, _, paths = saved(tmp_path)
    with open(paths[1], "r+b") as f:
        f.seek(MiB)
        byte = f.read(1)
        f.seek(MiB)
        f.write(bytes([byte[0] ^ 1]))
    os.truncate(paths[2], paths[2].stat().st_size - 4096)
    drop(paths)
    with pytest.raises(CASError, match="corrupt"):
        cas.open(tmp_path / "store").load("runs/r1/ckpt")
    repo.close()


def test_a_filesystem_refusing_direct_reads_is_read_through_the_page_cache_from_then_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, state, paths = saved(tmp_path)
    drop(paths)
    real = fcntl.fcntl
    refused: list[int] = []

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & direct.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refusing)
    monkeypatch.setattr(direct, "_cold_reads", True)  # restored after the test
    loaded = cas.open(tmp_path / "store").load("runs/r1/ckpt")
    assert np.array_equal(loaded["w"], state["w"])
    # Asked by the readers that met a cold chunk before the first refusal was remembered (one,
    # or two at once on a busy machine), then never again: the next cold load asks nothing.
    first = len(refused)
    assert 1 <= first <= default_readers(repo.blobs) and not direct.cold_reads()
    for path in paths:
        uncache(path)
    again = cas.open(tmp_path / "store").load("runs/r1/ckpt")
    assert np.array_equal(again["w"], state["w"]) and len(refused) == first
    repo.close()


def test_a_reader_finding_the_staging_pool_full_reads_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_reads: list[int]
) -> None:
    pool = StagingPool(4 * MiB)
    with pool.lease(4 * MiB - 4096):  # every byte the pool may hold
        with pool.lease_pages(2 * MiB) as none:
            assert none is None  # never waits: a save's worker may be the reader
        repo, state, paths = saved(tmp_path)
        drop(paths)
        monkeypatch.setattr("cas.objects.store.staging_pool", lambda: pool)
        loaded = cas.open(tmp_path / "store").load("runs/r1/ckpt")
        assert np.array_equal(loaded["w"], state["w"]) and direct_reads == []
    with pool.lease_pages(2 * MiB + 16) as pages:
        assert pages is not None and pages.ctypes.data % 4096 == 0
        assert pages.nbytes == 2 * MiB + 4096
    repo.close()


def test_cas_direct_reads_0_reads_cold_chunks_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_reads: list[int]
) -> None:
    repo, state, paths = saved(tmp_path)
    drop(paths)
    monkeypatch.setenv(direct.ENV_READS, "0")
    monkeypatch.setattr(direct, "_cold_reads", None)  # asked again, of the variable
    loaded = cas.open(tmp_path / "store").load("runs/r1/ckpt")
    assert np.array_equal(loaded["w"], state["w"]) and direct_reads == []
    assert not direct.cold_reads()
    for path in paths:  # read through the page cache: there now (a read that may not wait)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = path.stat().st_size
            assert os.preadv(fd, [bytearray(size)], 0, os.RWF_NOWAIT) == size
        finally:
            os.close(fd)
    repo.close()


def test_a_file_read_again_goes_through_the_page_cache_and_stays_there(
    tmp_path: Path, direct_reads: list[int]
) -> None:
    """Read once, past the page cache (a resume); read again, through it, so a process that
    loads one checkpoint over and over finds it cached from then on."""
    repo, state, paths = saved(tmp_path)
    store = cas.open(tmp_path / "store")
    for _ in range(3):
        assert np.array_equal(store.load("runs/r1/ckpt")["w"], state["w"])
    assert len(direct_reads) == 3  # the first load's three chunks only
    assert all(cached(path) * 4096 >= path.stat().st_size for path in paths)
    drop(paths)  # pushed out of the cache: read past it once more
    assert np.array_equal(store.load("runs/r1/ckpt")["w"], state["w"])
    assert len(direct_reads) == 6
    repo.close()


def test_a_kernel_without_cachestat_reads_through_the_page_cache_with_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_reads: list[int]
) -> None:
    repo, state, paths = saved(tmp_path)
    drop(paths)
    monkeypatch.setattr(direct, "_CACHESTAT", 99_999)  # no such call: ENOSYS, as before 6.5
    monkeypatch.setattr(direct, "_cold_reads", None)
    monkeypatch.setattr(readahead, "MIN_BYTES", MiB)
    started: list[ReadAhead] = []
    start = ReadAhead.start

    def recorded(self: ReadAhead) -> ReadAhead:
        started.append(self)
        return start(self)

    monkeypatch.setattr(ReadAhead, "start", recorded)
    loaded = cas.open(tmp_path / "store").load("runs/r1/ckpt")
    assert np.array_equal(loaded["w"], state["w"])
    assert not direct.cold_reads() and direct_reads == [] and len(started) == 1
    repo.close()
