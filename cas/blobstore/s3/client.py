"""S3 connection settings (``S3Options``) and the botocore clients built from them."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import botocore.session
from botocore.config import Config

MiB = 1 << 20


@dataclass(frozen=True)
class S3Options:
    """How to reach the bucket and how hard to try; ``cas.open`` accepts these as keywords."""

    endpoint_url: str | None = None
    """None: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` from the environment, else AWS."""
    region_name: str | None = None
    profile_name: str | None = None
    addressing_style: str | None = None
    """None: "path" for a custom endpoint (SeaweedFS, MinIO, Ceph), botocore's choice for AWS."""
    max_pool_connections: int = 64
    """Connections per client, and requests one managed transfer layer runs at once."""
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    max_attempts: int = 2
    """Attempts s3transfer makes per part of a large download (a read, safe to repeat). Every
    other request is made once: ``RetryingBlobStore`` is the one retry layer (see
    ``make_client``)."""
    multipart_threshold: int = 64 * MiB
    """Blobs larger than this go up as multipart uploads, their parts in parallel."""
    multipart_part_size: int = 16 * MiB
    """The part size of multipart uploads, and of the ranged GETs that fetch a blob larger than
    one part in parallel."""
    conditional_writes: bool | None = None
    """None: probe the server once; True/False: trust the caller and skip the probe."""


def make_client(options: S3Options, *, create_only: bool = False) -> Any:
    """A thread-safe botocore S3 client for ``options``; it makes each request once.

    botocore's own retries are off. A conditional write whose reply was lost (a 500 after the
    write landed, a reset connection) and that botocore retried would come back 412, and the
    caller could not tell its own landed write from another writer's: a push would report a
    false conflict, GC would find its own maintenance lock held, a save would record its
    history event twice. ``RetryingBlobStore`` retries instead, and knows that after a lost
    reply a 412 may be its own write.

    ``create_only``: every multipart upload the client completes carries ``If-None-Match: *``.
    s3transfer passes no condition to ``CompleteMultipartUpload`` (its argument lists leave it
    out), so create-only managed uploads go through such a client of their own.
    """
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
        retries={"mode": "standard", "total_max_attempts": 1},
        s3=s3_settings(endpoint, addressing),
        # Payloads are verified end to end by blake3, and several S3-compatible servers reject
        # the aws-chunked checksum trailers botocore sends by default since 1.36.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # A private session (the default one is not thread-safe to create clients from) that
    # shares the parsed service models: loading them again costs ~50 ms per store.
    session = botocore.session.Session(profile=options.profile_name)
    session.register_component("data_loader", _shared_loader(session))
    client = session.create_client(
        "s3", endpoint_url=endpoint, region_name=options.region_name, config=config
    )
    if create_only:
        client.meta.events.register(
            "before-parameter-build.s3.CompleteMultipartUpload", _complete_only_if_absent
        )
    return client


def s3_settings(endpoint: str | None, addressing: str | None) -> dict[str, Any]:
    """botocore's ``s3`` settings: the addressing style, and no SHA-256 of each request body
    over TLS (AWS when no endpoint is named, or an ``https://`` one).

    Without a checksum header (none is sent, see ``make_client``) botocore hashes every body
    it signs, a pass over each chunk a drain sends. Over TLS the transport already guards the
    bytes, and each chunk is checked by its blake3 digest when read back; over plain HTTP the
    signature is the only guard in transit, so bodies stay signed there.
    """
    settings: dict[str, Any] = {}
    if addressing:
        settings["addressing_style"] = addressing
    if endpoint is None or endpoint.lower().startswith("https://"):
        settings["payload_signing_enabled"] = False
    return settings


def _complete_only_if_absent(params: dict[str, Any], **_: Any) -> None:
    params["IfNoneMatch"] = "*"


_loader_lock = threading.Lock()
_loader: Any = None


def _shared_loader(session: botocore.session.Session) -> Any:
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = session.get_component("data_loader")
        return _loader
