"""Background checkpoint writes go to the disk with O_DIRECT, exactly, and fall back where refused."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import cas.blobstore.direct as direct
from cas.blobstore.local import TMP_DIR, LocalBlobStore
from cas.errors import BackendError
from cas.objects import chunk_key

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
    assert store.put_new_parts("chunks/ab/new", parts)
    store.put_parts("manifests/whole", parts)
    for key in ("chunks/ab/new", "manifests/whole"):
        path = store.path_of(key)
        assert path.stat().st_size == sum(sizes)
        assert store.get(key) == b"".join(parts)
    assert store.direct_io
    assert temp_files(store) == []
    # Read back above; a fresh put of the same size must not be in the page cache yet.
    store.put_parts("fresh", parts)
    assert not in_page_cache(store.path_of("fresh"), sum(sizes))


def test_small_blobs_and_ordinary_stores_go_through_the_page_cache(tmp_path: Path) -> None:
    small = LocalBlobStore(tmp_path / "small", direct_io=True)
    small.put("ref", b"x" * 4096)
    assert in_page_cache(small.path_of("ref"), 4096)

    big = os.urandom(2 << 20)
    buffered = LocalBlobStore(tmp_path / "buffered")  # a foreground store: read back soon
    assert not buffered.direct_io
    buffered.put("big", big)
    assert in_page_cache(buffered.path_of("big"), len(big))
    assert buffered.get("big") == big
    background = buffered.for_background_writes()
    assert background.direct_io and background.root == buffered.root
    assert background.get("big") == big


def test_a_managers_background_saves_skip_the_page_cache_and_plain_saves_do_not(
    tmp_path: Path,
) -> None:
    import torch

    import cas
    from cas.manager import CheckpointManager

    repo = cas.open(tmp_path / "store")
    state = {"w": torch.randn(1 << 19)}  # 2 MiB: one chunk
    repo.save(state, "plain/ckpt")
    with CheckpointManager(repo, run="runs/bg", signals=False, capture_rng=False) as mgr:
        ref = mgr.save(1, {"w": state["w"] + 1}).result().ref

    def chunk_files(name: str) -> list[Path]:
        chunks = [c for t in repo.manifest(name).tensors for c in t.chunks]
        return [repo.blobs.path_of(chunk_key(c.digest)) for c in chunks]

    plain, background = chunk_files("plain/ckpt"), chunk_files(ref)
    assert plain and background
    assert all(in_page_cache(p, p.stat().st_size) for p in plain)
    assert not any(in_page_cache(p, p.stat().st_size) for p in background)
    assert torch.equal(repo.load(ref)["state"]["w"], state["w"] + 1)


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

    monkeypatch.setattr(direct.os, "open", refusing_open)
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

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "write", full_disk)
    with pytest.raises(BackendError, match="No space left"):
        store.put_new_parts("chunks/ab/c", [os.urandom(2 << 20)])
    assert not store.has("chunks/ab/c")
    assert temp_files(store) == []
    assert store.direct_io  # a full disk says nothing about O_DIRECT support
