"""Probing an S3 server for the conditional writes it enforces, rather than trusting it to.

A server that silently ignores ``If-None-Match``/``If-Match`` would let two writers overwrite
each other's ref updates, so each ability is tried once, on a throwaway object below
``<prefix>/.cas-probe/``, before the store relies on it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import botocore.exceptions

from cas.blobstore.s3.client import S3Options
from cas.blobstore.s3.errors import (
    UNSUPPORTED_CODES,
    Location,
    error_code,
    http_status,
    is_precondition_failure,
    translated,
)

PROBE_DIR = ".cas-probe"
"""Conditional-write probes write and delete one object below ``<prefix>/.cas-probe/``."""


@dataclass(frozen=True)
class Capabilities:
    """The conditional requests a server enforces."""

    conditional_put: bool
    """``If-None-Match: *`` and ``If-Match`` on PutObject."""
    conditional_delete: bool
    """``If-Match`` on DeleteObject."""


def probe_capabilities(
    client: Any, bucket: str, prefix: str, options: S3Options, where: Location
) -> Capabilities:
    """Create a probe object twice with ``If-None-Match: *`` (the second must be refused), try a
    conditional delete with a wrong ETag (it must be refused), then delete the probe object.

    ``options.conditional_writes`` set to True or False skips the probe and is trusted.
    """
    forced = options.conditional_writes
    if forced is not None:
        return Capabilities(forced, forced)
    name = f"{prefix}{PROBE_DIR}/{uuid.uuid4().hex}"

    def create() -> None:
        client.put_object(Bucket=bucket, Key=name, Body=b"p", IfNoneMatch="*")

    def delete_if_mismatch() -> None:
        client.delete_object(Bucket=bucket, Key=name, IfMatch='"cas-no-match"')

    with translated(where, "probe conditional writes", f"{PROBE_DIR}/"):
        try:
            if _outcome(create) != "ok":
                return Capabilities(False, False)
            # A server that ignores If-None-Match lets the second create through.
            put = _outcome(create) == "refused"
            # One that ignores If-Match on delete removes the probe object instead of refusing.
            delete = put and _outcome(delete_if_mismatch) == "refused"
        finally:
            with suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                client.delete_object(Bucket=bucket, Key=name)
    return Capabilities(put, delete)


def probe_conditional_complete(
    client: Any, create_only_client: Any, bucket: str, prefix: str, where: Location
) -> bool:
    """Whether the server refuses to complete a multipart upload over an existing object when
    the completion carries ``If-None-Match: *`` (``create_only_client`` adds it to each one)."""
    name = f"{prefix}{PROBE_DIR}/{uuid.uuid4().hex}"
    upload_id = None

    def complete_over_existing() -> None:
        nonlocal upload_id
        upload_id = create_only_client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
        part = create_only_client.upload_part(
            Bucket=bucket, Key=name, UploadId=upload_id, PartNumber=1, Body=b"p"
        )
        create_only_client.complete_multipart_upload(
            Bucket=bucket,
            Key=name,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]},
        )
        upload_id = None

    with translated(where, "probe conditional multipart uploads", f"{PROBE_DIR}/"):
        try:
            client.put_object(Bucket=bucket, Key=name, Body=b"p")
            return _outcome(complete_over_existing) == "refused"
        finally:
            with suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if upload_id is not None:
                    client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id)
                client.delete_object(Bucket=bucket, Key=name)


def _outcome(call: Callable[[], None]) -> str:
    """Return ok, refused (412/409: the condition held) or unsupported (the server said so)."""
    try:
        call()
    except botocore.exceptions.ClientError as e:
        if is_precondition_failure(e):
            return "refused"
        if error_code(e) in UNSUPPORTED_CODES or http_status(e) == 501:
            return "unsupported"
        raise
    return "ok"
