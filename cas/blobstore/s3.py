"""S3BlobStore: blobs as objects under ``s3://bucket/prefix/`` on AWS S3 or an S3-compatible server.

Versions are ETags. For single-part objects S3-compatible servers use the MD5 of the content, so
two writes of identical bytes share a version (like ``LocalBlobStore``'s content hash); callers
that need A -> B -> A to be visible put a unique token in the payload.

Compare-and-swap uses S3 conditional writes (``If-None-Match: *`` to create, ``If-Match: <etag>``
to replace, ``If-Match`` on DeleteObject), and so do create-only chunk puts (``put_new_parts``,
``If-None-Match: *``). Servers that silently ignore those headers are detected once by a probe,
after which ``supports_conditional_writes`` is False and the conditional methods fall back to
check-then-write under a process-local lock, which is not safe across processes.
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields, replace
from typing import Any, NoReturn

import botocore.exceptions
import botocore.session
from botocore.config import Config

from cas.blobstore.base import BlobInfo, BlobStore, Version, check_key
from cas.errors import (
    BackendError,
    CASError,
    InvalidName,
    NotFound,
    PreconditionFailed,
    TransientBackendError,
)

MiB = 1 << 20
PROBE_DIR = ".cas-probe"
"""Conditional-write probes write and delete one object below ``<prefix>/.cas-probe/``."""
_MAX_PARTS = 10_000

_PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)
_UNSUPPORTED_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})


@dataclass(frozen=True)
class S3Options:
    """How to reach the bucket and how hard to try; ``from_url`` accepts these as keywords."""

    endpoint_url: str | None = None
    """None: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` from the environment, else AWS."""
    region_name: str | None = None
    profile_name: str | None = None
    addressing_style: str | None = None
    """None: "path" for a custom endpoint (SeaweedFS, MinIO, Ceph), botocore's choice for AWS."""
    max_pool_connections: int = 64
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    max_attempts: int = 2
    """Total attempts botocore makes per request; ``RetryingBlobStore`` does the real retrying."""
    multipart_threshold: int = 64 * MiB
    multipart_part_size: int = 16 * MiB
    conditional_writes: bool | None = None
    """None: probe the server once; True/False: trust the caller and skip the probe."""


@dataclass(frozen=True)
class _Capabilities:
    conditional_put: bool
    conditional_delete: bool


class S3BlobStore(BlobStore):
    """Blobs as S3 objects named ``<prefix>/<key>`` in one bucket, through one botocore client.

    The client is thread-safe and pools up to ``max_pool_connections`` connections, so one store
    serves many threads. ``put`` is one PutObject (atomic by S3 semantics) or, above
    ``multipart_threshold``, a multipart upload that becomes visible only on completion. Puts
    are durable when they return, so ``sync`` is a no-op.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        options: S3Options | None = None,
        client: Any | None = None,
    ) -> None:
        self.options = options or S3Options()
        if not bucket or "/" in bucket:
            raise InvalidName(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self._prefix = f"{prefix}/" if prefix else ""
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._client = client if client is not None else _make_client(self.options)
        self.endpoint_url: str = self._client.meta.endpoint_url
        self._capabilities: _Capabilities | None = None
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

    def _where(self, key: str | None) -> str:
        return f"{self.url}/{key}" if key else self.url

    @contextmanager
    def _errors(
        self, op: str, key: str | None = None, expected: Version | None = None
    ) -> Iterator[None]:
        """Translate botocore failures into the cas error tree at this edge."""
        try:
            yield
        except botocore.exceptions.ClientError as e:
            raise self._translate(e, op, key, expected) from e
        except (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
            botocore.exceptions.IncompleteReadError,
        ) as e:
            raise TransientBackendError(
                f"cannot reach S3 endpoint {self.endpoint_url} ({op} {self._where(key)}): "
                f"{_one_line(str(e))}"
            ) from e
        except botocore.exceptions.NoCredentialsError as e:
            raise BackendError(
                f"no AWS credentials found for {self.url} at {self.endpoint_url}; set "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
            ) from e
        except botocore.exceptions.BotoCoreError as e:
            raise BackendError(
                f"S3 {op} {self._where(key)} at {self.endpoint_url} failed: {_one_line(str(e))}"
            ) from e

    def _translate(
        self,
        e: botocore.exceptions.ClientError,
        op: str,
        key: str | None,
        expected: Version | None = None,
    ) -> CASError:
        code, status = _error_code(e), _http_status(e)
        where = self._where(key)
        if code in _PRECONDITION_CODES or status == 412:
            why = f"its version is no longer {expected}" if expected else "it exists already"
            return PreconditionFailed(f"{op} of {where} lost: {why} ({code or status})")
        if code == "NoSuchBucket":
            return BackendError(f"bucket {self.bucket!r} does not exist at {self.endpoint_url}")
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFound(f"no blob {key!r} in {self.url}")
        if code in _CREDENTIAL_CODES:
            return BackendError(
                f"{self.endpoint_url} rejected the credentials for {self.url} ({code}); check "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
            )
        if code == "AccessDenied" or status == 403:
            return BackendError(
                f"access denied to {self.url} at {self.endpoint_url} ({op}); check the "
                "credentials, the bucket policy and that the bucket exists"
            )
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return TransientBackendError(
                f"S3 {op} {where} at {self.endpoint_url}: {status} {code} (retryable)"
            )
        message = _one_line(str(e.response.get("Error", {}).get("Message", "")))
        return BackendError(
            f"S3 {op} {where} at {self.endpoint_url} failed: {status} {code} {message}".rstrip()
        )

    def get(self, key: str) -> bytes:
        name = self._name(key)
        with self._errors("get", key):
            response = self._client.get_object(Bucket=self.bucket, Key=name)
            return bytes(response["Body"].read())

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0:
            raise ValueError(f"negative range start {start}")
        if end <= start:
            self.stat(key)  # an empty range of a missing blob still raises NotFound
            return b""
        name = self._name(key)
        with self._errors("get_range", key):
            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end - 1}"
                )
            except botocore.exceptions.ClientError as e:
                # 416 means the blob exists (a missing one is 404) and starts before ``start``.
                if _error_code(e) == "InvalidRange" or _http_status(e) == 416:
                    return b""
                raise
            return bytes(response["Body"].read())

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        name = self._name(key)
        view = memoryview(data).cast("B")
        with self._errors("put", key):
            if len(view) > self.options.multipart_threshold:
                self._put_multipart(name, view)
            else:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=_body(data))

    def _put_multipart(self, name: str, view: memoryview) -> None:
        part_size = max(self.options.multipart_part_size, math.ceil(len(view) / _MAX_PARTS))
        upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        try:
            parts = []
            for number, offset in enumerate(range(0, len(view), part_size), start=1):
                response = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=view[offset : offset + part_size].tobytes(),
                )
                parts.append({"ETag": response["ETag"], "PartNumber": number})
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            # Unfinished uploads are invisible but billed; the bucket's lifecycle rule is the
            # backstop when this abort cannot reach the server either.
            with suppress(Exception):
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=name, UploadId=upload_id
                )
            raise

    def has(self, key: str) -> bool:
        try:
            self.stat(key)
        except NotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        name = self._name(key)
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=name)

    def list(self, prefix: str = "") -> Iterator[str]:
        for info in self._list_objects(prefix):
            yield info.key

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        yield from self._list_objects(prefix)

    def _list_objects(self, prefix: str) -> Iterator[BlobInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        strip = len(self._prefix)
        with self._errors("list", prefix or None):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._prefix + prefix):
                for obj in page.get("Contents", ()):
                    name: str = obj["Key"]
                    # Other tools create "directory" marker objects; they are not blobs.
                    if name.endswith("/"):
                        continue
                    yield BlobInfo(name[strip:], int(obj["Size"]), obj["LastModified"].timestamp())

    def stat(self, key: str) -> BlobInfo:
        name = self._name(key)
        with self._errors("stat", key):
            response = self._client.head_object(Bucket=self.bucket, Key=name)
        return BlobInfo(key, int(response["ContentLength"]), response["LastModified"].timestamp())

    def touch(self, key: str) -> None:
        """Copy the object onto itself so LastModified moves; the ETag (version) stays.

        Meant for content-addressed blobs: a copy racing a put of different bytes to the same key
        may win and bring the old bytes back. Servers that refuse the self-copy get a re-put.
        """
        name = self._name(key)
        if self._touch_by_copy:
            with self._errors("touch", key):
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
                    if _error_code(e) not in _UNSUPPORTED_CODES:
                        raise
            self._touch_by_copy = False
        self.put(key, self.get(key))

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        name = self._name(key)
        with self._errors("get", key):
            response = self._client.get_object(Bucket=self.bucket, Key=name)
            return bytes(response["Body"].read()), Version(response["ETag"])

    def _current_version(self, key: str) -> Version | None:
        name = self._name(key)
        try:
            with self._errors("stat", key):
                return Version(self._client.head_object(Bucket=self.bucket, Key=name)["ETag"])
        except NotFound:
            return None

    def put_conditional(
        self, key: str, data: bytes | bytearray | memoryview, expected: Version | None
    ) -> Version:
        name = self._name(key)
        if not self._capabilities_now().conditional_put:
            return self._put_check_then_write(key, data, expected)
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        with self._errors("put_conditional", key, expected):
            response = self._client.put_object(
                Bucket=self.bucket, Key=name, Body=_body(data), **condition
            )
        etag = response.get("ETag")
        return Version(etag) if etag else self._version_after_write(key)

    def put_new_parts(self, key: str, parts: Sequence[bytes | bytearray | memoryview]) -> bool:
        """Create-only PutObject with ``If-None-Match: *``; a 412 means the key exists: False.

        Always a single PutObject, whatever the size (S3 takes up to 5 GiB in one; chunks are at
        most 64 MiB and a header): a multipart upload would need the condition on its completion,
        which not every server supports. A 409 ConditionalRequestConflict (another write of the
        key is in flight) is transient: once it lands, a retry gets the 412. Without conditional
        writes on the server this is the base class's check-then-write, racy across processes.
        """
        if not self._capabilities_now().conditional_put:
            return super().put_new_parts(key, parts)
        name = self._name(key)
        body = b"".join(parts)
        with self._errors("put_new", key):
            try:
                self._client.put_object(Bucket=self.bucket, Key=name, Body=body, IfNoneMatch="*")
            except botocore.exceptions.ClientError as e:
                code = _error_code(e)
                if code == "ConditionalRequestConflict":
                    raise TransientBackendError(
                        f"S3 put_new {self._where(key)} at {self.endpoint_url}: a concurrent "
                        f"write of the same key is in flight ({code}, retryable)"
                    ) from e
                if code in _PRECONDITION_CODES or _http_status(e) == 412:
                    return False
                raise
        return True

    def _version_after_write(self, key: str) -> Version:
        version = self._current_version(key)
        if version is None:
            raise BackendError(f"{self._where(key)} vanished right after a conditional write")
        return version

    def _put_check_then_write(
        self, key: str, data: bytes | bytearray | memoryview, expected: Version | None
    ) -> Version:
        """Fallback for servers without conditional writes: racy across processes."""
        with self._fallback_lock:
            current = self._current_version(key)
            if current != expected:
                self._lost(key, expected, current)
            name = self._name(key)
            with self._errors("put_conditional", key):
                response = self._client.put_object(Bucket=self.bucket, Key=name, Body=_body(data))
        etag = response.get("ETag")
        return Version(etag) if etag else self._version_after_write(key)

    def _lost(self, key: str, expected: Version | None, current: Version | None) -> NoReturn:
        raise PreconditionFailed(
            f"{self._where(key)} changed (expected {expected or 'no blob'}, "
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
            with self._errors("delete_conditional", key, expected):
                self._client.delete_object(Bucket=self.bucket, Key=name, IfMatch=expected)
        except NotFound as e:
            raise PreconditionFailed(f"{self._where(key)} is gone (expected {expected})") from e

    @property
    def supports_conditional_writes(self) -> bool:
        """Whether the server enforces If-None-Match/If-Match on PutObject (probed once)."""
        return self._capabilities_now().conditional_put

    def check_bucket(self) -> None:
        """Raise a one-line BackendError unless the bucket exists and these credentials reach it.

        Some servers (SeaweedFS among them) create a missing bucket on the first PUT into it, so
        a typo in a bucket name would silently start a new store without this check.
        """
        with self._errors("head bucket", None):
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as e:
                if _http_status(e) == 404 or _error_code(e) in ("NoSuchBucket", "404", "NotFound"):
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

    def _capabilities_now(self) -> _Capabilities:
        if self._capabilities is None:
            with self._probe_lock:
                if self._capabilities is None:
                    self._capabilities = self._probe_capabilities()
        return self._capabilities

    def _probe_capabilities(self) -> _Capabilities:
        forced = self.options.conditional_writes
        if forced is not None:
            return _Capabilities(forced, forced)
        name = f"{self._prefix}{PROBE_DIR}/{uuid.uuid4().hex}"

        def create() -> None:
            self._client.put_object(Bucket=self.bucket, Key=name, Body=b"p", IfNoneMatch="*")

        def delete_if_mismatch() -> None:
            self._client.delete_object(Bucket=self.bucket, Key=name, IfMatch='"cas-no-match"')

        with self._errors("probe conditional writes", f"{PROBE_DIR}/"):
            try:
                if _probe_outcome(create) != "ok":
                    return _Capabilities(False, False)
                # A server that ignores If-None-Match lets the second create through.
                put = _probe_outcome(create) == "refused"
                # One that ignores If-Match on delete removes the probe object instead of refusing.
                delete = put and _probe_outcome(delete_if_mismatch) == "refused"
            finally:
                with suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                    self._client.delete_object(Bucket=self.bucket, Key=name)
        return _Capabilities(put, delete)

    def close(self) -> None:
        self._client.close()


def _make_client(options: S3Options) -> Any:
    endpoint = (
        options.endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or None
    )
    addressing = options.addressing_style or ("path" if endpoint else None)
    config = Config(
        max_pool_connections=options.max_pool_connections,
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        retries={"mode": "standard", "total_max_attempts": options.max_attempts},
        s3={"addressing_style": addressing} if addressing else None,
        # Payloads are verified end to end by blake3, and several S3-compatible servers reject
        # the aws-chunked checksum trailers botocore sends by default since 1.36.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # A private session (the default one is not thread-safe to create clients from) that
    # shares the parsed service models: loading them again costs ~50 ms per store.
    session = botocore.session.Session(profile=options.profile_name)
    session.register_component("data_loader", _shared_loader(session))
    return session.create_client(
        "s3", endpoint_url=endpoint, region_name=options.region_name, config=config
    )


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader(session: botocore.session.Session) -> Any:
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
        return _loader


def _body(data: bytes | bytearray | memoryview) -> bytes | bytearray:
    return bytes(data) if isinstance(data, memoryview) else data


def _probe_outcome(call: Callable[[], None]) -> str:
    """Return ok, refused (412/409: the condition held) or unsupported (the server said so)."""
    try:
        call()
    except botocore.exceptions.ClientError as e:
        if _error_code(e) in _PRECONDITION_CODES or _http_status(e) == 412:
            return "refused"
        if _error_code(e) in _UNSUPPORTED_CODES or _http_status(e) == 501:
            return "unsupported"
        raise
    return "ok"


def _error_code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _http_status(e: botocore.exceptions.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _one_line(text: str) -> str:
    return " ".join(text.split())
