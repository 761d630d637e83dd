"""S3 errors: botocore and s3transfer failures translated into the cas error tree, one line each."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import botocore.exceptions

from cas.blobstore.base import Version
from cas.errors import BackendError, CASError, NotFound, PreconditionFailed, TransientBackendError

PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict"})
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
TRANSIENT_CODES = frozenset(
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
UNSUPPORTED_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})


@dataclass(frozen=True)
class Location:
    """Where a request went, as an error message names it."""

    url: str
    """``s3://bucket/prefix``"""
    bucket: str
    endpoint_url: str

    def of(self, key: str | None) -> str:
        """The URL of ``key``, or of the store itself."""
        return f"{self.url}/{key}" if key else self.url


def _unreachable() -> tuple[type[Exception], ...]:
    """The failures that mean the endpoint could not be reached. s3transfer's own is among them
    once a managed transfer has loaded it (``cas.blobstore.s3.transfer``): only those raise it."""
    found: tuple[type[Exception], ...] = (
        botocore.exceptions.ConnectionError,
        botocore.exceptions.HTTPClientError,
        botocore.exceptions.IncompleteReadError,
    )
    transfer = sys.modules.get("s3transfer.exceptions")
    return found if transfer is None else (*found, transfer.RetriesExceededError)


@contextmanager
def translated(
    where: Location, op: str, key: str | None = None, expected: Version | None = None
) -> Iterator[None]:
    """Translate botocore and s3transfer failures inside the block into the cas error tree."""
    try:
        yield
    except botocore.exceptions.ClientError as e:
        raise translate(e, where, op, key, expected) from e
    except _unreachable() as e:
        raise TransientBackendError(
            f"cannot reach S3 endpoint {where.endpoint_url} ({op} {where.of(key)}): "
            f"{one_line(str(e))}"
        ) from e
    except botocore.exceptions.NoCredentialsError as e:
        raise BackendError(
            f"no AWS credentials found for {where.url} at {where.endpoint_url}; set "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        ) from e
    except botocore.exceptions.BotoCoreError as e:
        raise BackendError(
            f"S3 {op} {where.of(key)} at {where.endpoint_url} failed: {one_line(str(e))}"
        ) from e


def translate(
    e: botocore.exceptions.ClientError,
    where: Location,
    op: str,
    key: str | None,
    expected: Version | None = None,
) -> CASError:
    """The cas error for one S3 error answer."""
    code, status = error_code(e), http_status(e)
    if code in PRECONDITION_CODES or status == 412:
        why = f"its version is no longer {expected}" if expected else "it exists already"
        return PreconditionFailed(f"{op} of {where.of(key)} lost: {why} ({code or status})")
    if code == "NoSuchBucket":
        return BackendError(f"bucket {where.bucket!r} does not exist at {where.endpoint_url}")
    if code in NOT_FOUND_CODES or status == 404:
        return NotFound(f"no blob {key!r} in {where.url}")
    if code in CREDENTIAL_CODES:
        return BackendError(
            f"{where.endpoint_url} rejected the credentials for {where.url} ({code}); check "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    if code == "AccessDenied" or status == 403:
        return BackendError(
            f"access denied to {where.url} at {where.endpoint_url} ({op}); check the "
            "credentials, the bucket policy and that the bucket exists"
        )
    if code in TRANSIENT_CODES or status >= 500 or status == 429:
        return TransientBackendError(
            f"S3 {op} {where.of(key)} at {where.endpoint_url}: {status} {code} (retryable)"
        )
    message = one_line(str(e.response.get("Error", {}).get("Message", "")))
    return BackendError(
        f"S3 {op} {where.of(key)} at {where.endpoint_url} failed: {status} {code} {message}".rstrip()
    )


def is_precondition_failure(e: botocore.exceptions.ClientError) -> bool:
    """Whether the server refused a conditional request because its condition did not hold."""
    return error_code(e) in PRECONDITION_CODES or http_status(e) == 412


def error_code(e: botocore.exceptions.ClientError) -> str:
    """The S3 error code (``NoSuchKey``...), or "" when the answer carried none."""
    return str(e.response.get("Error", {}).get("Code", ""))


def http_status(e: botocore.exceptions.ClientError) -> int:
    """The HTTP status of the answer, or 0."""
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines too) as one space."""
    return " ".join(text.split())
