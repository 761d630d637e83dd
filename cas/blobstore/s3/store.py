"""S3BlobStore: blobs as objects under ``s3://bucket/prefix/`` on AWS S3 or an S3-compatible server.

Versions are ETags. For single-part objects S3-compatible servers use the MD5 of the content, so
two writes of identical bytes share a version (like ``LocalBlobStore``'s content hash); callers
that need A -> B -> A to be visible put a unique token in the payload.

Compare-and-swap uses S3 conditional writes (``If-None-Match: *`` to create, ``If-Match: <etag>``
to replace, ``If-Match`` on DeleteObject), and so do create-only puts (``put_if_absent``,
``If-None-Match: *`` on the PutObject, or on the completion of a multipart upload). Servers that
silently ignore those headers are detected once by a probe (``cas.blobstore.s3.probe``), after
which ``supports_conditional_writes`` is False and the conditional methods fall back to
check-then-write under a process-local lock, which is not safe across processes.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any, NoReturn

import botocore.exceptions

from cas.blobstore.base import (
    BlobInfo,
    BlobStore,
    BytesLike,
    Payload,
    Version,
    check_key,
    joined,
    parts_of,
)
from cas.blobstore.s3.client import S3Options, make_client
from cas.blobstore.s3.errors import (
    UNSUPPORTED_CODES,
    Location,
    error_code,
    http_status,
    is_precondition_failure,
    translated,
)
from cas.blobstore.s3.probe import (
    Capabilities,
    probe_capabilities,
    probe_conditional_complete,
)
from cas.blobstore.s3.transfer import ManagedTransfers
from cas.errors import (
    BackendError,
    CASError,
    InvalidName,
    NotFound,
    PreconditionFailed,
    TransientBackendError,
)

SINGLE_PUT_MAX = 5 << 30
"""The largest object one PutObject may carry."""


class S3BlobStore(BlobStore):
    """Blobs as S3 objects named ``<prefix>/<key>`` in one bucket.

    One botocore client (thread-safe, pooling up to ``max_pool_connections`` connections) serves
    every thread. Blobs above ``multipart_threshold`` move through boto3's managed transfers:
    multipart uploads whose parts go up at once, visible only on completion, and ranged GETs
    fetched at once. Puts are durable when they return, so ``sync`` is a no-op.
    """

    def __init__(self, bucket: str, prefix: str = "", *, options: S3Options | None = None) -> None:
        self.options = options or S3Options()
        if not bucket or "/" in bucket:
            raise InvalidName(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self._prefix = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._client = make_client(self.options)
        self.endpoint_url: str = self._client.meta.endpoint_url
        self._where = Location(self.url, bucket, self.endpoint_url)
        self._transfers = ManagedTransfers(self._client, self.options, bucket)
        self._capabilities: Capabilities | None = None
        self._complete_condition: bool | None = None
        self._probe_lock = threading.Lock()
        # Serializes the check-then-write fallback within this process only.
        self._fallback_lock = threading.Lock()
        self._touch_by_copy = True

    @classmethod
    def from_url(cls, url: str, endpoint_url: str | None = None, **opts: Any) -> S3BlobStore:
        """Open ``s3://bucket/prefix``; ``opts`` are ``S3Options`` fields."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("s3", "s3a"):
            raise InvalidName(f"not an s3:// URL: {url!r}")
        bucket, _, prefix = rest.partition("/")
        known = {f.name for f in fields(S3Options)}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise TypeError(f"unknown S3 options {unknown}; known: {sorted(known)}")
        options = replace(S3Options(), endpoint_url=endpoint_url, **opts)
        return cls(bucket, prefix, options=options)

    def _name(self, key: str) -> str:
        return self._prefix + check_key(key)

    def get(self, key: str) -> bytes:
        """One GET; a blob above ``multipart_threshold`` is fetched again as parts at once.

        The first answer's length decides, so a blob of usual size costs one request and no
        thread hand-off; for a large one the first answer is dropped after its headers.
        """
        name = self._name(key)
        try:
            with translated(self._where, "get", key):
                response = self._client.get_object(Bucket=self.bucket, Key=name)
                body = response["Body"]
                if int(response["ContentLength"]) <= self.options.multipart_threshold:
                    return bytes(body.read())
                body.close()
                return self._transfers.download(name)
        except PreconditionFailed as e:
            # A part of a blob larger than one part is asked for with If-Match: the blob was
            # replaced while it was read, and reading it again gets the new one whole.
            raise TransientBackendError(f"{self._where.of(key)} changed while it was read") from e

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0:
            raise ValueError(f"negative range start {start}")
        if end <= start:
            self.stat(key)  # an empty range of a missing blob still raises NotFound
            return b""
        name = self._name(key)
        with translated(self._where, "get_range", key):
            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end - 1}"
                )
            except botocore.exceptions.ClientError as e:
                # 416 means the blob exists (a missing one is 404) and starts before ``start``.
                if error_code(e) == "InvalidRange" or http_status(e) == 416:
                    return b""
                raise
            return bytes(response["Body"].read())

    def stat(self, key: str) -> BlobInfo:
        name = self._name(key)
        with translated(self._where, "stat", key):
            response = self._client.head_object(Bucket=self.bucket, Key=name)
        return BlobInfo(key, int(response["ContentLength"]), response["LastModified"].timestamp())

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        strip = len(self._prefix)
        with translated(self._where, "list", prefix or None):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._prefix + prefix):
                for obj in page.get("Contents", ()):
                    name: str = obj["Key"]
                    # Other tools create "directory" marker objects; they are not blobs.
                    if name.endswith("/"):
                        continue
                    yield BlobInfo(name[strip:], int(obj["Size"]), obj["LastModified"].timestamp())

    def put(self, key: str, data: Payload) -> None:
        name = self._name(key)
        size = sum(memoryview(part).nbytes for part in parts_of(data))
        with translated(self._where, "put", key):
            if size > self.options.multipart_threshold:
                self._transfers.upload(name, data)
            else:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=_body(data))

    def put_if_absent(self, key: str, data: Payload) -> bool:
        """Create-only: ``If-None-Match: *`` on the PutObject, or on the completion of a
        multipart upload above ``multipart_threshold`` where the server honours it there (probed
        once, on the first such put); a 412 means the key exists: False.

        A 409 ConditionalRequestConflict (another write of the key is in flight) is transient:
        once it lands, a retry gets the 412. Without conditional writes on the server this is a
        check-then-write under a process-local lock, racy across processes.
        """
        capabilities = self._capabilities_now()
        if not capabilities.conditional_put:
            with self._fallback_lock:
                if self.has(key):
                    return False
                self.put(key, data)
                return True
        name = self._name(key)
        size = sum(memoryview(part).nbytes for part in parts_of(data))
        multipart = size > self.options.multipart_threshold and (
            size > SINGLE_PUT_MAX or self._conditional_complete()
        )
        with translated(self._where, "put_if_absent", key):
            try:
                if multipart:
                    self._transfers.upload(name, data, create_only=True)
                else:
                    self._client.put_object(
                        Bucket=self.bucket, Key=name, Body=_body(data), IfNoneMatch="*"
                    )
            except botocore.exceptions.ClientError as e:
                code = error_code(e)
                if code == "ConditionalRequestConflict":
                    raise TransientBackendError(
                        f"S3 put_if_absent {self._where.of(key)} at {self.endpoint_url}: a "
                        f"concurrent write of the same key is in flight ({code}, retryable)"
                    ) from e
                if is_precondition_failure(e):
                    return False
                raise
        return True

    def touch(self, key: str) -> None:
        """Copy the object onto itself so LastModified moves; the ETag (version) stays.

        Meant for content-addressed blobs: a copy racing a put of different bytes to the same key
        may win and bring the old bytes back. Servers that refuse the self-copy get a re-put.
        """
        name = self._name(key)
        if self._touch_by_copy:
            with translated(self._where, "touch", key):
                try:
                    self._client.copy_object(
                        Bucket=self.bucket,
                        Key=name,
                        CopySource={"Bucket": self.bucket, "Key": name},
                        # A self-copy must change something; a fresh value always does.
                        MetadataDirective="REPLACE",
                        Metadata={"cas-touched": uuid.uuid4().hex},
                    )
                    return
                except botocore.exceptions.ClientError as e:
                    if error_code(e) not in UNSUPPORTED_CODES:
                        raise
            self._touch_by_copy = False
        self.put(key, self.get(key))

    def delete(self, key: str) -> None:
        name = self._name(key)
        with translated(self._where, "delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=name)

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        name = self._name(key)
        with translated(self._where, "get", key):
            response = self._client.get_object(Bucket=self.bucket, Key=name)
            return bytes(response["Body"].read()), Version(response["ETag"])

    def _current_version(self, key: str) -> Version | None:
        name = self._name(key)
        try:
            with translated(self._where, "stat", key):
                return Version(self._client.head_object(Bucket=self.bucket, Key=name)["ETag"])
        except NotFound:
            return None

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        name = self._name(key)
        if not self._capabilities_now().conditional_put:
            return self._put_check_then_write(key, data, expected)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        with translated(self._where, "put_conditional", key, expected):
            response = self._client.put_object(
                Bucket=self.bucket, Key=name, Body=_body(data), **condition
            )
        etag = response.get("ETag")
        return Version(etag) if etag else self._version_after_write(key)

    def _version_after_write(self, key: str) -> Version:
        version = self._current_version(key)
        if version is None:
            raise BackendError(f"{self._where.of(key)} vanished right after a conditional write")
        return version

    def _put_check_then_write(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        """Fallback for servers without conditional writes: racy across processes."""
        with self._fallback_lock:
            current = self._current_version(key)
            if current != expected:
                self._lost(key, expected, current)
            name = self._name(key)
            with translated(self._where, "put_conditional", key):
                response = self._client.put_object(Bucket=self.bucket, Key=name, Body=_body(data))
        etag = response.get("ETag")
        return Version(etag) if etag else self._version_after_write(key)

    def _lost(self, key: str, expected: Version | None, current: Version | None) -> NoReturn:
        raise PreconditionFailed(
            f"{self._where.of(key)} changed (expected {expected or 'no blob'}, "
            f"found {current or 'no blob'})"
        )

    def delete_conditional(self, key: str, expected: Version) -> None:
        """Delete only if the ETag is ``expected``.

        Without server support for If-Match on DeleteObject this checks the ETag and then
        deletes; a write landing between the two is deleted with it.
        """
        name = self._name(key)
        if not self._capabilities_now().conditional_delete:
            with self._fallback_lock:
                current = self._current_version(key)
                if current != expected:
                    self._lost(key, expected, current)
                self.delete(key)
            return
        try:
            with translated(self._where, "delete_conditional", key, expected):
                self._client.delete_object(Bucket=self.bucket, Key=name, IfMatch=expected)
        except NotFound as e:
            raise PreconditionFailed(f"{self._where.of(key)} is gone (expected {expected})") from e

    @property
    def supports_conditional_writes(self) -> bool:
        """Whether the server enforces If-None-Match/If-Match on PutObject (probed once)."""
        return self._capabilities_now().conditional_put

    def check_bucket(self) -> None:
        """Raise a one-line BackendError unless the bucket exists and these credentials reach it.

        Some servers (SeaweedFS among them) create a missing bucket on the first PUT into it, so
        a typo in a bucket name would silently start a new store without this check.
        """
        with translated(self._where, "head bucket"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as e:
                if http_status(e) == 404 or error_code(e) in ("NoSuchBucket", "404", "NotFound"):
                    raise BackendError(
                        f"bucket {self.bucket!r} does not exist at {self.endpoint_url}"
                    ) from e
                raise

    def check_conditional_writes(self) -> None:
        """Raise CASError unless several writers can safely share this store."""
        if not self.supports_conditional_writes:
            raise CASError(
                f"S3 endpoint {self.endpoint_url} ignores If-None-Match/If-Match on PutObject, "
                f"so concurrent writers to {self.url} could overwrite each other's refs; use one "
                "writer, or a server with conditional writes (AWS S3, SeaweedFS, MinIO)"
            )

    def _capabilities_now(self) -> Capabilities:
        if self._capabilities is None:
            with self._probe_lock:
                if self._capabilities is None:
                    self._capabilities = probe_capabilities(
                        self._client, self.bucket, self._prefix, self.options, self._where
                    )
        return self._capabilities

    def _conditional_complete(self) -> bool:
        """Whether the server honours If-None-Match on CompleteMultipartUpload: probed once, on
        the first create-only put that needs it (``conditional_writes=True`` is trusted)."""
        if self._complete_condition is None:
            with self._probe_lock:
                if self._complete_condition is None:
                    forced = self.options.conditional_writes
                    self._complete_condition = (
                        forced
                        if forced is not None
                        else probe_conditional_complete(
                            self._client,
                            self._transfers.create_only_client,
                            self.bucket,
                            self._prefix,
                            self._where,
                        )
                    )
        return self._complete_condition

    def close(self) -> None:
        self._transfers.close()
        self._client.close()


def _body(data: Payload) -> bytes | bytearray:
    whole = joined(data)
    return bytes(whole) if isinstance(whole, memoryview) else whole
