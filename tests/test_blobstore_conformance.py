"""Every blob-store backend and wrapper passes the shared BlobStore conformance suite."""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from cas.blobstore import (
    BlobStore,
    LocalBlobStore,
    MemoryBlobStore,
    ReadOnlyBlobStore,
    open_blobstore,
    read_into,
)
from cas.blobstore.cache import CachingBlobStore
from cas.blobstore.fsspec_store import FsspecBlobStore
from cas.blobstore.retry import RetryingBlobStore, RetryPolicy
from cas.blobstore.s3 import S3BlobStore
from cas.errors import ReadOnlyError
from cas.testing import BlobStoreConformance, ManualClock, ReadOnlyConformance
from cas.testing.faulty import FaultyBlobStore
from cas.testing.seaweed import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, REGION, SeaweedServer

MiB = 1 << 20


class TestMemoryBlobStore(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        self.clock = ManualClock()
        return MemoryBlobStore(clock=self.clock)


class TestLocalBlobStore(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        return LocalBlobStore(self.tmp_path / "store")


class TestDirectLocalBlobStore(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        return LocalBlobStore(self.tmp_path / "store").for_background_writes()


class TestFsspecMemoryBlobStore(BlobStoreConformance):
    conditional_writes = True  # process-local compare-and-swap is what this backend offers

    def make_store(self) -> BlobStore:
        # fsspec's memory filesystem is one dict per process: a unique root isolates tests.
        return open_blobstore(f"memory://cas-test-{uuid.uuid4().hex}")


class TestFsspecLocalBlobStore(BlobStoreConformance):
    conditional_writes = True

    def make_store(self) -> BlobStore:
        return FsspecBlobStore(LocalFileSystem(), str(self.tmp_path / "store"))


@pytest.mark.s3
class TestS3BlobStore(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        return S3BlobStore.from_url(self.fixture("s3_url"))


@pytest.mark.s3
class TestS3BlobStoreInParts(BlobStoreConformance):
    """Multipart uploads and ranged downloads from 5 MiB, so the suite's larger blobs use them."""

    def make_store(self) -> BlobStore:
        return S3BlobStore.from_url(
            self.fixture("s3_url"), multipart_threshold=5 * MiB, multipart_part_size=5 * MiB
        )


@pytest.mark.s3
class TestFsspecS3fsBlobStore(BlobStoreConformance):
    conditional_writes = True

    def make_store(self) -> BlobStore:
        s3fs = pytest.importorskip("s3fs")
        seaweed: SeaweedServer = self.fixture("seaweed")
        url = self.fixture("s3_url")
        fs = s3fs.S3FileSystem(
            key=DUMMY_ACCESS_KEY,
            secret=DUMMY_SECRET_KEY,
            endpoint_url=seaweed.endpoint_url,
            client_kwargs={"region_name": REGION},
            skip_instance_cache=True,
        )
        return open_blobstore(url, filesystem=fs)


class TestRetryingOverFaultyBlobStore(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        faulty = FaultyBlobStore(MemoryBlobStore(), rate=0.05, after_write=0.5, seed=7)
        policy = RetryPolicy(attempts=20, base_delay=0.0, max_delay=0.0)
        return RetryingBlobStore(faulty, policy, sleep=lambda _: None, rng=random.Random(0))


class TestFaultyBlobStoreWithFaultsOff(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        self.clock = ManualClock()
        return FaultyBlobStore(MemoryBlobStore(clock=self.clock))


class TestCachingBlobStore(BlobStoreConformance):
    def make_store(self) -> BlobStore:
        return CachingBlobStore(
            LocalBlobStore(self.tmp_path / "cache"),
            LocalBlobStore(self.tmp_path / "remote"),
            prefixes=("chunks/", "manifests/"),
            verify=lambda through, key, blob: None,
        )


class TestReadOnlyLocalBlobStore(ReadOnlyConformance):
    def make_store(self) -> BlobStore:
        return ReadOnlyBlobStore(LocalBlobStore(self.tmp_path / "store"))


class TestReadOnlyMemoryBlobStore(ReadOnlyConformance):
    def make_store(self) -> BlobStore:
        return ReadOnlyBlobStore(MemoryBlobStore())


def test_a_local_transient_put_skips_the_fsyncs_a_put_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalBlobStore(tmp_path / "store")
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    store.put_transient("leases/w1", b"lease")
    store.sync()
    assert synced == []
    assert store.get("leases/w1") == b"lease"
    assert list((tmp_path / "store" / "tmp").rglob("*.tmp")) == []  # no temp left
    store.put("leases/w2", b"lease")
    store.sync()
    assert len(synced) == 2  # the file, then its directory


def test_a_local_write_into_a_new_directory_makes_the_directory_itself_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new directory's entry lives in its parent: for a crash to keep a chunk written into a
    # new fan-out directory (or a ref under a new run's directory), the parent is fsynced too.
    import cas.blobstore.local as local

    root = tmp_path / "store"
    store = LocalBlobStore(root)
    synced: list[Path] = []
    real = local._fsync_dir

    def recording(directory: Path) -> None:
        synced.append(Path(directory))
        real(directory)

    monkeypatch.setattr(local, "_fsync_dir", recording)
    key = "chunks/ab/" + "ab" * 32
    assert store.put_if_absent(key, b"chunk")
    store.sync()
    assert sorted(synced) == [root, root / "chunks", root / "chunks" / "ab"]
    synced.clear()
    assert store.put_if_absent("chunks/ab/" + "ab" * 31 + "cd", b"other")
    store.sync()
    assert synced == [root / "chunks" / "ab"]  # nothing new above it this time
    synced.clear()
    store.put_conditional("refs/runs/r1/latest", b"ref", None)
    assert synced == [root / "refs" / "runs" / "r1", root / "refs" / "runs", root / "refs", root]


def test_open_blobstore_routes_fsspec_urls_to_fsspec_store() -> None:
    store = open_blobstore(f"memory://cas-route-{uuid.uuid4().hex}")
    assert isinstance(store, FsspecBlobStore)
    assert isinstance(store.fs, MemoryFileSystem)
    assert not store.supports_conditional_writes


def test_a_read_only_store_refuses_create_only_puts() -> None:
    inner = MemoryBlobStore()
    with pytest.raises(ReadOnlyError):
        ReadOnlyBlobStore(inner).put_if_absent("chunks/a", (b"x",))
    assert not inner.has("chunks/a")


def test_a_read_only_local_store_still_reads_in_place(tmp_path: Path) -> None:
    inner = LocalBlobStore(tmp_path)
    inner.put("chunks/a", b"header+payload")
    store = ReadOnlyBlobStore(inner)
    assert store.reads_in_place and store.local_path("chunks/a") == tmp_path / "chunks/a"
    head, rest = memoryview(bytearray(6)), memoryview(bytearray(20))
    assert read_into(store, "chunks/a", 0, [head, rest]) == 14
    assert bytes(head) + bytes(rest[:8]) == b"header+payload"
