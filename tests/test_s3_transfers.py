"""Large blobs move to and from S3 in parts sent at once, and create-only holds for them too."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from moto import mock_aws

import cas
from cas.blobstore.fsspec_store import FsspecBlobStore
from cas.blobstore.retry import RetryingBlobStore
from cas.blobstore.s3 import PROBE_DIR, S3BlobStore
from cas.testing.seaweed import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, REGION, SeaweedServer

MiB = 1 << 20


def _in_parts(url: str) -> S3BlobStore:
    """A store that sends blobs above 5 MiB in 5 MiB parts."""
    return S3BlobStore.from_url(url, multipart_threshold=5 * MiB, multipart_part_size=5 * MiB)


class _Meeting:
    """An event hook that holds the first ``parties`` requests of one kind until all have
    arrived: requests sent one after another never all arrive, and the wait times out."""

    def __init__(self, parties: int, skip: int = 0) -> None:
        self.barrier = threading.Barrier(parties, timeout=20)
        self.parties = parties
        self.skip = skip
        self.seen = 0
        self._lock = threading.Lock()

    def __call__(self, **_: Any) -> None:
        with self._lock:
            self.seen += 1
            index = self.seen - self.skip
        if 0 < index <= self.parties:
            self.barrier.wait()


@pytest.mark.s3
@pytest.mark.parametrize("create_only", [False, True], ids=["put", "put_if_absent"])
def test_a_large_blob_goes_up_in_parts_sent_at_once(s3_url: str, create_only: bool) -> None:
    store = _in_parts(s3_url)
    data = os.urandom(12 * MiB)  # three parts
    if create_only:
        assert store._conditional_complete()  # SeaweedFS honours If-None-Match on completion
    meeting = _Meeting(parties=3)
    client = store._transfers.create_only_client if create_only else store._client
    client.meta.events.register("before-call.s3.UploadPart", meeting)
    if create_only:
        assert store.put_if_absent("chunks/big", data) is True
    else:
        store.put("chunks/big", data)
    assert meeting.seen == 3
    assert store.get("chunks/big") == data
    assert list(store.list(PROBE_DIR)) == []


@pytest.mark.s3
def test_a_large_blob_comes_down_in_ranges_fetched_at_once(s3_url: str) -> None:
    store = _in_parts(s3_url)
    data = os.urandom(16 * MiB)
    store.put("chunks/big", data)
    # A plain GET learns the size, the managed download's first ranged GET the ETag, and the
    # three other parts are fetched at once.
    meeting = _Meeting(parties=3, skip=2)
    store._client.meta.events.register("before-call.s3.GetObject", meeting)
    assert store.get("chunks/big") == data
    assert meeting.seen == 5
    assert (
        store.get_range("chunks/big", 5 * MiB - 3, 5 * MiB + 3) == data[5 * MiB - 3 : 5 * MiB + 3]
    )


@pytest.mark.s3
def test_a_large_create_only_put_never_replaces_what_is_there(s3_url: str) -> None:
    store = _in_parts(s3_url)
    first, second = os.urandom(11 * MiB), os.urandom(11 * MiB)
    assert store.put_if_absent("chunks/big", first) is True
    assert store.put_if_absent("chunks/big", second) is False
    assert store.get("chunks/big") == first
    uploads = store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    assert [u for u in uploads if u["Key"].endswith("chunks/big")] == []  # the loser aborted


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        yield


def _strip_if_none_match(request: Any, **_: Any) -> None:
    del request.headers["If-None-Match"]


def test_a_server_ignoring_the_condition_on_multipart_completion_gets_single_puts(
    moto_s3: None,
) -> None:
    # moto honours If-None-Match on CompleteMultipartUpload; dropping the header on the way
    # out imitates a server that honours it on PutObject only.
    store = _in_parts("s3://legacy-multipart/cas")
    store._client.create_bucket(Bucket="legacy-multipart")
    store._transfers.create_only_client.meta.events.register(
        "before-sign.s3.CompleteMultipartUpload", _strip_if_none_match
    )
    first, second = os.urandom(11 * MiB), os.urandom(11 * MiB)
    assert store.supports_conditional_writes
    assert store.put_if_absent("chunks/big", first) is True
    assert store.put_if_absent("chunks/big", second) is False
    assert store.get("chunks/big") == first
    assert list(store.list(PROBE_DIR)) == []


@pytest.mark.s3
def test_cas_stores_through_a_users_s3fs_filesystem(s3_url: str, seaweed: SeaweedServer) -> None:
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(
        key=DUMMY_ACCESS_KEY,
        secret=DUMMY_SECRET_KEY,
        endpoint_url=seaweed.endpoint_url,
        client_kwargs={"region_name": REGION},
        skip_instance_cache=True,
    )
    state = {"step": 7, "weights": list(range(1000))}
    repo = cas.open(s3_url, filesystem=fs)
    repo.save(state, "runs/r1/latest")
    assert isinstance(repo.blobs, RetryingBlobStore)
    assert isinstance(repo.blobs.inner, FsspecBlobStore) and repo.blobs.inner.fs is fs
    # The same objects, read back through boto3.
    assert cas.open(s3_url, readonly=True).load("runs/r1/latest") == state
