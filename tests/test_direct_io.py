"""Background checkpoint writes go to the disk with O_DIRECT, exactly, and fall back where refused."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cas.blobstore.direct as direct
from cas.blobstore.local import TMP_DIR, LocalBlobStore
from cas.errors import BackendError
from cas.objects.envelope import HEADER_SIZE
from cas.objects.staging import StagingPool
from tests.helpers import ref_chunk_paths

pytestmark = pytest.mark.skipif(not direct.O_DIRECT, reason="this platform has no O_DIRECT")


def in_page_cache(path: Path, size: int) -> bool:
    """Whether every byte of ``path`` can be read without touching the disk (RWF_NOWAIT)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(size)], 0, os.RWF_NOWAIT) == size
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def temp_files(store: LocalBlobStore) -> list[Path]:
    return [p for p in (store.root / TMP_DIR).iterdir() if p.is_file()]


def address(buffer: bytes | memoryview) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def random_at(residue: int, size: int) -> memoryview:
    """``size`` random bytes whose first one sits ``residue`` bytes past a page boundary."""
    region = mmap.mmap(-1, residue + size + 1)
    region[residue : residue + size] = os.urandom(size)
    return memoryview(region)[residue : residue + size]


Iovecs = list[tuple[int, int]]


def record_iovecs(monkeypatch: pytest.MonkeyPatch, cap: int | None = None) -> list[Iovecs]:
    """Each ``pwritev`` call's buffers as ``(address, nbytes)``; with ``cap``, every call writes
    at most ``cap`` bytes, as a short write would."""
    calls: list[Iovecs] = []
    real_pwritev = os.pwritev

    def pwritev(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        calls.append([(address(b), memoryview(b).nbytes) for b in buffers])
        return real_pwritev(fd, buffers if cap is None else shortened(buffers, cap), offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    return calls


def shortened(buffers: Sequence[memoryview], cap: int) -> list[memoryview]:
    """The first ``cap`` bytes of ``buffers``, cut where they end."""
    out = []
    for buffer in buffers:
        if cap <= 0:
            break
        out.append(memoryview(buffer)[:cap])
        cap -= out[-1].nbytes
    return out


def bytes_handed_from(calls: list[Iovecs], memory: Sequence[memoryview]) -> int:
    """Bytes ``pwritev`` was given straight from ``memory`` rather than from a copy."""
    ranges = [(address(m), address(m) + m.nbytes) for m in memory]
    return sum(
        n for call in calls for at, n in call if any(lo <= at and at + n <= hi for lo, hi in ranges)
    )


def whole_blocks(offset: int, size: int) -> int:
    """Bytes of ``ALIGN`` blocks lying wholly inside ``[offset, offset + size)``."""
    align = direct.ALIGN
    return max(0, (offset + size) // align * align - -(-offset // align) * align)


MiB = 1 << 20
HEADER = (HEADER_SIZE, False)


@pytest.mark.parametrize(
    "layout",
    [
        [HEADER],
        [(0, True)],
        [HEADER, (1, True)],
        [HEADER, (4095, True)],
        [HEADER, (4096 - HEADER_SIZE, True)],
        [HEADER, (4096, True)],
        [HEADER, (4097, True)],
        [HEADER, (4 * MiB, True)],
        [HEADER, (4 * MiB, False)],
        [(3 * 4096, True)],
        [(4096, True), (0, True), (4096, True)],
        [HEADER, (2 * MiB + 5, True), (MiB + 3, False), (8191, True), (3 * MiB, True)],
    ],
    ids=lambda layout: "+".join(f"{n}{'c' if c else 'i'}" for n, c in layout),
)
def test_direct_writes_send_congruent_blocks_from_where_they_lie_and_copy_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: list[tuple[int, bool]]
) -> None:
    """``(size, congruent)``: a congruent part sits in memory where it goes in the file, modulo
    ``ALIGN``; the others sit 8 bytes off."""
    calls = record_iovecs(monkeypatch)
    parts, in_place, offset = [], 0, 0
    for size, congruent in layout:
        parts.append(random_at((offset + (0 if congruent else 8)) % direct.ALIGN, size))
        in_place += whole_blocks(offset, size) if congruent else 0
        offset += size
    path = tmp_path / "blob"
    direct.write_direct(path, parts, offset, direct.AlignedBuffers(), fsync=False)
    assert path.read_bytes() == b"".join(parts)
    assert bytes_handed_from(calls, parts) == in_place
    assert sum(n for call in calls for _, n in call) == max(direct.ALIGN, -(-offset // 4096) * 4096)


@pytest.mark.parametrize("iov_max", [1, 2, 3])
def test_a_direct_write_goes_on_after_short_writes_and_splits_at_the_iovec_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, iov_max: int
) -> None:
    monkeypatch.setattr(direct, "IOV_MAX", iov_max)
    calls = record_iovecs(monkeypatch, cap=3 * direct.ALIGN)  # stops inside the in-place run
    parts = [random_at(0, HEADER_SIZE), random_at(HEADER_SIZE, MiB + 100)]
    path = tmp_path / "blob"
    direct.write_direct(path, parts, MiB + 116, direct.AlignedBuffers(), fsync=False)
    assert path.read_bytes() == b"".join(parts)
    assert len(calls) > 2 and all(len(call) <= iov_max for call in calls)


@pytest.mark.parametrize(
    "sizes",
    [[1 << 20], [(1 << 20) + 1], [40, (3 << 20) + 17], [4095, 1, 4 << 20], [(8 << 20) - 1]],
    ids=["1MiB", "1MiB+1", "header+3MiB+17", "unaligned-parts", "8MiB-1"],
)
def test_a_large_blob_is_written_past_the_page_cache_and_reads_back_exactly(
    tmp_path: Path, sizes: list[int]
) -> None:
    store = LocalBlobStore(tmp_path / "store").for_background_writes()
    parts = [os.urandom(n) for n in sizes]
    assert store.put_if_absent("chunks/ab/new", parts)
    store.put("manifests/whole", parts)
    for key in ("chunks/ab/new", "manifests/whole"):
        path = store.root / key
        assert path.stat().st_size == sum(sizes)
        assert store.get(key) == b"".join(parts)
    assert store.direct_io
    assert temp_files(store) == []
    # Read back above; a fresh put of the same size must not be in the page cache yet.
    store.put("fresh", parts)
    assert not in_page_cache(store.root / "fresh", sum(sizes))


def test_small_blobs_and_ordinary_stores_go_through_the_page_cache(tmp_path: Path) -> None:
    small = LocalBlobStore(tmp_path / "small", direct_io=True)
    small.put("ref", b"x" * 4096)
    assert in_page_cache(small.root / "ref", 4096)

    big = os.urandom(2 << 20)
    buffered = LocalBlobStore(tmp_path / "buffered")  # a foreground store: read back soon
    assert not buffered.direct_io
    buffered.put("big", big)
    assert in_page_cache(buffered.root / "big", len(big))
    assert buffered.get("big") == big
    background = buffered.for_background_writes()
    assert background.direct_io and background.root == buffered.root
    assert background.get("big") == big


def test_new_chunks_of_plain_and_background_saves_skip_the_page_cache(tmp_path: Path) -> None:
    import torch

    import cas
    from cas.training.manager import CheckpointManager

    repo = cas.open(tmp_path / "store")
    state = {"w": torch.randn(1 << 19)}  # 2 MiB: one chunk
    repo.save(state, "plain/ckpt")
    with CheckpointManager(repo, run="runs/bg", signals=False, capture_rng=False) as mgr:
        ref = mgr.save(1, {"w": state["w"] + 1}).result().ref

    plain, background = ref_chunk_paths(repo, "plain/ckpt"), ref_chunk_paths(repo, ref)
    assert plain and background
    # A full save writes new bytes only: through the staging pool and past the page cache.
    assert not any(in_page_cache(p, p.stat().st_size) for p in plain + background)
    assert torch.equal(repo.load(ref)["state"]["w"], state["w"] + 1)
    assert torch.equal(repo.load("plain/ckpt")["w"], state["w"])


def test_a_filesystem_refusing_o_direct_gets_buffered_writes_from_then_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open
    refused = []

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & direct.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    store = LocalBlobStore(tmp_path / "store", direct_io=True)
    data = [os.urandom(3 << 20) for _ in range(2)]
    store.put("a", data[0])
    assert not store.direct_io
    store.put("b", data[1])
    assert len(refused) == 1  # asked once; the second write went buffered straight away
    assert [store.get("a"), store.get("b")] == data
    assert temp_files(store) == []


def test_a_direct_write_that_fails_leaves_no_temp_file_and_no_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalBlobStore(tmp_path / "store", direct_io=True)

    def full_disk(fd: int, buffers: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full_disk)
    with pytest.raises(BackendError, match="No space left"):
        store.put_if_absent("chunks/ab/c", [os.urandom(2 << 20)])
    assert not store.has("chunks/ab/c")
    assert temp_files(store) == []
    assert store.direct_io  # a full disk says nothing about O_DIRECT support


def test_the_stager_starts_large_tensors_where_their_raw_chunks_write_in_place() -> None:
    import torch

    from cas.training.async_save import Stager

    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.bool, torch.complex128]
    large = {str(dtype): torch.ones(MiB // dtype.itemsize, dtype=dtype) for dtype in dtypes}
    state = {
        **large,
        "matrix": torch.randn(1024, 512).t(),  # not contiguous: staged by torch's copy
        "small": torch.randn(3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, MiB),
    }
    stager = Stager(pin_memory=False)
    staging = stager.acquire()
    first = stager.snapshot(state, staging)
    for key, tensor in state.items():
        state[key] = tensor + 1 if tensor.dtype != torch.bool else ~tensor
    again = stager.snapshot(state, staging)
    for key, tensor in state.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    for key in [*large, "matrix"]:
        assert again[key].data_ptr() % direct.ALIGN == HEADER_SIZE, key
        assert again[key].data_ptr() == first[key].data_ptr(), key  # reused, not reallocated


def test_an_async_save_copies_each_chunk_once_and_writes_it_from_that_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import cas
    import cas.objects.private
    from cas.training.async_save import Stager, StagingSet
    from cas.training.manager import CheckpointManager

    staged: list[memoryview] = []
    real_snapshot = Stager.snapshot

    def snapshot(self: Stager, state: object, staging: StagingSet) -> object:
        copied = real_snapshot(self, state, staging)
        staged.extend(memoryview(t.view(-1).view(torch.uint8).numpy()) for t in leaves(copied))
        return copied

    # The chunk door hashes and writes one private reading of each chunk (invariant 9): a buffer
    # leased from the staging pool, laid out so the direct write sends it in place.
    private: list[memoryview] = []
    real_lease = StagingPool.lease

    @contextlib.contextmanager
    def lease(self: StagingPool, nbytes: int) -> Iterator[Any]:
        with real_lease(self, nbytes) as staged:
            private.append(memoryview(staged))
            yield staged

    monkeypatch.setattr(Stager, "snapshot", snapshot)
    monkeypatch.setattr(StagingPool, "lease", lease)
    calls = record_iovecs(monkeypatch)
    repo = cas.open(tmp_path / "store")
    state = {"w": torch.randn(2 * MiB // 4), "b": torch.randn(16)}  # one 2 MiB chunk, one inline
    with CheckpointManager(repo, run="runs/bg", signals=False, capture_rng=False) as mgr:
        ref = mgr.save(1, state).result().ref
    assert torch.equal(repo.load(ref)["state"]["w"], state["w"])
    assert len(private) == 1 and bytes_handed_from(calls, staged) == 0
    # All but the chunk's first block (header + 4080 bytes) and last (16 bytes + padding).
    assert bytes_handed_from(calls, private) == 2 * MiB - direct.ALIGN


def test_private_copies_of_chunks_start_where_a_raw_chunk_payload_does() -> None:
    from cas.objects.private import PAYLOAD_OFFSET

    assert PAYLOAD_OFFSET == HEADER_SIZE


def leaves(tree: object) -> list[Any]:
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in leaves(value)]
    return []


def test_a_directly_written_chunk_keeps_its_head_in_the_page_cache(tmp_path: Path) -> None:
    """The next save reads each reused chunk's first 16 KiB to judge it: that head is read back
    into the page cache once written, the rest of the chunk is not."""
    import time

    import torch

    import cas

    repo = cas.open(tmp_path / "store")
    repo.save({"w": torch.randn(1 << 20)}, "runs/a")  # one 4 MiB chunk
    (path,) = ref_chunk_paths(repo, "runs/a")
    deadline = time.monotonic() + 5
    while not in_page_cache(path, direct.HEAD_CACHED) and time.monotonic() < deadline:
        time.sleep(0.01)  # the read back is asynchronous
    assert in_page_cache(path, direct.HEAD_CACHED)
    assert not in_page_cache(path, path.stat().st_size)
