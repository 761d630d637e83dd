"""S3 failures reach the user as one clear line from the cas error tree, never a botocore dump."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import botocore.client
import numpy as np
import pytest
from botocore.awsrequest import AWSResponse
from moto import mock_aws

import cas
from cas.blobstore.s3 import PROBE_DIR, S3BlobStore
from cas.errors import (
    BackendError,
    CASError,
    NotFound,
    PreconditionFailed,
    TransientBackendError,
)
from cas.testing.seaweed import SeaweedServer

pytestmark = pytest.mark.s3


def _assert_one_line_naming(error: BaseException, *names: str) -> None:
    message = str(error)
    assert "\n" not in message, message
    for name in names:
        assert name in message, message


def test_a_missing_bucket_is_named_in_a_one_line_error(s3_url: str, seaweed: SeaweedServer) -> None:
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    store = S3BlobStore.from_url(f"s3://{bucket}/run")
    for read in (lambda: store.get("chunks/a"), lambda: list(store.list("chunks/"))):
        with pytest.raises(BackendError) as caught:
            read()
        assert not isinstance(caught.value, (NotFound, TransientBackendError))
        _assert_one_line_naming(caught.value, bucket, seaweed.endpoint_url)
    # SeaweedFS answers a PUT into a missing bucket with AccessDenied, not NoSuchBucket.
    with pytest.raises(BackendError) as caught:
        store.put("chunks/a", b"data")
    assert not isinstance(caught.value, TransientBackendError)
    _assert_one_line_naming(caught.value, bucket, seaweed.endpoint_url)


def test_a_read_only_open_asks_nothing_before_its_first_read_and_still_names_a_missing_bucket(
    s3_url: str, seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cas.open(s3_url).save({"w": np.arange(4)}, "runs/r1/ckpt")
    calls: list[str] = []
    original = botocore.client.BaseClient._make_api_call

    def counted(self: Any, operation: str, params: Any) -> Any:
        calls.append(operation)
        return original(self, operation, params)

    monkeypatch.setattr(botocore.client.BaseClient, "_make_api_call", counted)
    reader = cas.open(s3_url, readonly=True)
    assert calls == ["GetObject"]  # the store's config: no HeadBucket, no probe of writes
    assert np.array_equal(reader.load("runs/r1/ckpt")["w"], np.arange(4))
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    with pytest.raises(BackendError) as caught:
        cas.open(f"s3://{bucket}/run", readonly=True)
    _assert_one_line_naming(caught.value, bucket)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unreachable_endpoint_is_a_transient_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    endpoint = f"http://127.0.0.1:{_unused_port()}"
    store = S3BlobStore.from_url(
        "s3://bucket/prefix", endpoint_url=endpoint, max_attempts=1, connect_timeout=1
    )
    with pytest.raises(TransientBackendError) as caught:
        store.get("chunks/a")
    _assert_one_line_naming(caught.value, endpoint, "s3://bucket/prefix/chunks/a")


def test_a_server_that_never_answers_times_out_as_transient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts connections in the kernel, never reads or answers
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        store = S3BlobStore.from_url(
            "s3://bucket", endpoint_url=endpoint, max_attempts=1, read_timeout=0.3
        )
        with pytest.raises(TransientBackendError) as caught:
            store.stat("chunks/a")
    _assert_one_line_naming(caught.value, endpoint)


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._data


def _answer_every_request_with(status: int, code: str) -> Callable[..., AWSResponse]:
    body = f"<Error><Code>{code}</Code><Message>injected {code}</Message></Error>".encode()

    def answer(request: Any, **_: Any) -> AWSResponse:
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    return answer


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (503, "SlowDown", True),
        (500, "InternalError", True),
        (429, "TooManyRequests", True),
        (403, "InvalidAccessKeyId", False),
        (403, "SignatureDoesNotMatch", False),
        (403, "AccessDenied", False),
    ],
)
def test_server_answers_map_to_transient_or_permanent_errors(
    s3_url: str, status: int, code: str, transient: bool
) -> None:
    store = S3BlobStore.from_url(s3_url, max_attempts=1)
    store._client.meta.events.register_first(
        "before-send.s3", _answer_every_request_with(status, code)
    )
    with pytest.raises(BackendError) as caught:
        store.put("chunks/a", b"data")
    assert isinstance(caught.value, TransientBackendError) == transient
    _assert_one_line_naming(caught.value, s3_url)


@pytest.mark.parametrize(
    ("status", "code", "outcome"),
    [
        (412, "PreconditionFailed", "exists"),
        (409, "ConditionalRequestConflict", "transient"),
        (403, "AccessDenied", "error"),
    ],
)
def test_create_only_put_answers_map_to_false_or_errors(
    s3_url: str, status: int, code: str, outcome: str
) -> None:
    store = S3BlobStore.from_url(s3_url, max_attempts=1, conditional_writes=True)
    store._client.meta.events.register_first(
        "before-send.s3", _answer_every_request_with(status, code)
    )
    if outcome == "exists":
        assert store.put_if_absent("chunks/a", (b"data",)) is False
        return
    with pytest.raises(BackendError) as caught:
        store.put_if_absent("chunks/a", (b"data",))
    assert isinstance(caught.value, TransientBackendError) == (outcome == "transient")
    _assert_one_line_naming(caught.value, s3_url)


def test_seaweedfs_enforces_conditional_writes_and_the_probe_cleans_up(s3_url: str) -> None:
    store = S3BlobStore.from_url(s3_url)
    store.check_conditional_writes()
    assert store.supports_conditional_writes
    assert list(store.list(PROBE_DIR)) == []


def _strip_condition_headers(request: Any, **_: Any) -> None:
    for header in ("If-None-Match", "If-Match"):
        del request.headers[header]


@pytest.fixture
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        yield


def test_a_server_ignoring_conditional_headers_is_refused_for_many_writers(
    moto_s3: None,
) -> None:
    store = S3BlobStore.from_url("s3://legacy/cas")
    store._client.create_bucket(Bucket="legacy")
    # moto honours If-None-Match/If-Match; dropping them on the way out imitates an old server.
    store._client.meta.events.register("before-sign.s3.PutObject", _strip_condition_headers)
    store._client.meta.events.register("before-sign.s3.DeleteObject", _strip_condition_headers)

    assert not store.supports_conditional_writes
    with pytest.raises(CASError) as caught:
        store.check_conditional_writes()
    _assert_one_line_naming(caught.value, "If-None-Match", "s3://legacy/cas")
    assert list(store.list(PROBE_DIR)) == []

    # Within this process the fallback still refuses a stale version.
    first = store.put_conditional("refs/main", b"one", None)
    second = store.put_conditional("refs/main", b"two", first)
    with pytest.raises(PreconditionFailed):
        store.put_conditional("refs/main", b"lost", first)
    with pytest.raises(PreconditionFailed):
        store.delete_conditional("refs/main", first)
    store.delete_conditional("refs/main", second)
    assert not store.has("refs/main")
    # Create-only chunk puts fall back to check-then-write, still create-only in this process.
    assert store.put_if_absent("chunks/ab/c", (b"first",)) is True
    assert store.put_if_absent("chunks/ab/c", (b"second",)) is False
    assert store.get("chunks/ab/c") == b"first"


def test_moto_conditional_writes_are_detected(moto_s3: None) -> None:
    store = S3BlobStore.from_url("s3://modern/cas")
    store._client.create_bucket(Bucket="modern")
    store.check_conditional_writes()
    version = store.put_conditional("refs/main", b"one", None)
    with pytest.raises(PreconditionFailed):
        store.put_conditional("refs/main", b"two", None)
    assert store.get_versioned("refs/main") == (b"one", version)
    assert store.put_if_absent("chunks/ab/c", (b"first",)) is True
    assert store.put_if_absent("chunks/ab/c", (b"second",)) is False
    assert store.get("chunks/ab/c") == b"first"


def test_touch_keeps_the_version_so_a_ref_cas_still_matches(s3_url: str) -> None:
    store = S3BlobStore.from_url(s3_url)
    version = store.put_conditional("refs/main", b"one", None)
    store.touch("refs/main")
    assert store.get_versioned("refs/main") == (b"one", version)
    store.put_conditional("refs/main", b"two", version)


def test_from_url_reads_bucket_prefix_and_rejects_unknown_options(s3_url: str) -> None:
    store = S3BlobStore.from_url("s3://bucket/deep/prefix/")
    assert (store.bucket, store.url) == ("bucket", "s3://bucket/deep/prefix")
    with pytest.raises(TypeError, match="unknown S3 options"):
        S3BlobStore.from_url("s3://bucket", no_such_option=1)
    with pytest.raises(ValueError):
        S3BlobStore.from_url("s3://bucket/../escape")


def test_a_store_recovers_after_the_server_restarts(s3_url: str, seaweed: SeaweedServer) -> None:
    store = S3BlobStore.from_url(s3_url, max_attempts=1, connect_timeout=1)
    store.put("chunks/a", b"before")
    seaweed.stop()
    try:
        with pytest.raises(TransientBackendError):
            store.get("chunks/a")
    finally:
        seaweed.start()
    assert store.get("chunks/a") == b"before"
    store.put("chunks/b", b"after")
    assert sorted(store.list("chunks/")) == ["chunks/a", "chunks/b"]
