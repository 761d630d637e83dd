"""Managed S3 transfers (boto3's s3transfer): parallel multipart uploads, concurrent ranged GETs.

The store uses them for blobs above ``multipart_threshold`` only: for a blob of a few MiB (a
chunk) the thread hand-offs of a managed transfer cost more than they save. A download starts
with one ranged GET of the first part; the other parts are fetched at once, each pinned to the
first answer's ETag, so a blob replaced meanwhile is never stitched together from two versions.
An upload sends its parts at once and becomes visible only when the upload completes.
"""

from __future__ import annotations

import io
import threading
from typing import Any

from cas.blobstore.base import Payload, joined
from cas.blobstore.s3.client import MiB, S3Options, make_client

IO_CHUNK_SIZE = 4 * MiB
"""Bytes a download hands to its writer at once. s3transfer's 256 KiB default halved the rate
of downloads into memory on a 2-core machine."""


class ManagedTransfers:
    """The transfer managers of one store, made on first use and shut down by ``close``.

    Create-only uploads go through a second client whose multipart completions carry
    ``If-None-Match: *`` (``make_client(create_only=True)``), as s3transfer passes no condition
    to ``CompleteMultipartUpload`` itself.
    """

    def __init__(self, client: Any, options: S3Options, bucket: str) -> None:
        self.client = client
        self.options = options
        self.bucket = bucket
        self._lock = threading.Lock()
        self._managers: dict[bool, Any] = {}
        self._create_only_client: Any = None

    @property
    def create_only_client(self) -> Any:
        """The client whose multipart completions are create-only."""
        with self._lock:
            if self._create_only_client is None:
                self._create_only_client = make_client(self.options, create_only=True)
            return self._create_only_client

    def _manager(self, create_only: bool) -> Any:
        # boto3 and s3transfer load with the first large blob: a store of chunks never needs them.
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        client = self.create_only_client if create_only else self.client
        with self._lock:
            manager = self._managers.get(create_only)
            if manager is None:
                config = TransferConfig(
                    multipart_threshold=self.options.multipart_threshold,
                    multipart_chunksize=self.options.multipart_part_size,
                    max_concurrency=self.options.max_pool_connections,
                    io_chunksize=IO_CHUNK_SIZE,
                    num_download_attempts=self.options.max_attempts,
                )
                manager = create_transfer_manager(client, config)
                self._managers[create_only] = manager
            return manager

    def download(self, name: str) -> bytes:
        """The whole object ``name``."""
        out = io.BytesIO()
        self._manager(False).download(self.bucket, name, out).result()
        return out.getvalue()

    def upload(self, name: str, data: Payload, *, create_only: bool = False) -> None:
        """Store ``data`` as ``name`` in parts sent at once (one PutObject below the threshold).

        ``create_only``: the completion carries ``If-None-Match: *``, so it fails with 412 if
        ``name`` exists, and s3transfer then aborts the upload.
        """
        body = io.BytesIO(joined(data))
        self._manager(create_only).upload(body, self.bucket, name).result()

    def close(self) -> None:
        """Stop the managers' threads and close the create-only client."""
        with self._lock:
            managers, self._managers = list(self._managers.values()), {}
            client, self._create_only_client = self._create_only_client, None
        for manager in managers:
            manager.shutdown()
        if client is not None:
            client.close()
