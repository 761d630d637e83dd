"""Blob stores: the storage backends cas runs on, their wrappers, and opening one by URL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
from cas.blobstore.bulk import has_many, read_into, touch_many
from cas.blobstore.local import LocalBlobStore
from cas.blobstore.memory import MemoryBlobStore
from cas.blobstore.readonly import ReadOnlyBlobStore
from cas.blobstore.wrapper import WRITE_METHODS, BlobStoreWrapper
from cas.errors import CASError, NotFound

__all__ = [
    "WRITE_METHODS",
    "BlobInfo",
    "BlobStore",
    "BlobStoreWrapper",
    "BytesLike",
    "LocalBlobStore",
    "MemoryBlobStore",
    "Payload",
    "ReadOnlyBlobStore",
    "Version",
    "check_key",
    "has_many",
    "joined",
    "open_blobstore",
    "open_for_use",
    "parts_of",
    "read_into",
    "touch_many",
]


def open_blobstore(url: str | os.PathLike[str], **options: Any) -> BlobStore:
    """Open the blob store a URL names: a path, ``file://``, ``memory://``, ``s3://`` or fsspec.

    ``filesystem=`` (an fsspec filesystem, e.g. an ``s3fs.S3FileSystem`` configured elsewhere)
    opens ``url`` on that filesystem instead, whatever its scheme: ``FsspecBlobStore``.
    """
    text = os.fspath(url)
    filesystem = options.pop("filesystem", None)
    if filesystem is not None:
        from cas.blobstore.fsspec_store import FsspecBlobStore

        return FsspecBlobStore.on(filesystem, text, **options)
    if "://" not in text:
        try:
            path = Path(text).expanduser()
        except RuntimeError as e:  # ~user with no such user
            raise NotFound(f"store path {text!r}: {e}") from None
        return LocalBlobStore(path, **options)
    scheme, _, rest = text.partition("://")
    if scheme == "file":
        return LocalBlobStore(Path(rest), **options)
    if scheme == "memory" and not rest:
        return MemoryBlobStore()
    if scheme in ("s3", "s3a"):
        from cas.blobstore.s3 import S3BlobStore

        return S3BlobStore.from_url(text, **options)
    from cas.blobstore.fsspec_store import FsspecBlobStore

    return FsspecBlobStore.from_url(text, **options)


def open_for_use(
    url: str | os.PathLike[str], *, shared_writer: bool, readonly: bool = False, **options: Any
) -> BlobStore:
    """Open the store ``url`` names as a repository uses it.

    A store on this machine is returned as it is. A remote one is checked (an S3 bucket must
    exist: some servers would create a mistyped one on the first write) and wrapped in retries
    (``RetryingBlobStore``). With ``shared_writer`` (this process writes, and others may too)
    an S3 server that ignores conditional writes is refused: concurrent writers could then
    overwrite each other's ref updates and delta chunks. A ``readonly`` handle skips the bucket
    check (a request before any read): it writes nothing a mistyped bucket could receive, and
    its first read of a missing bucket fails naming it.
    """
    store = open_blobstore(url, **options)
    if isinstance(store, (LocalBlobStore, MemoryBlobStore)):
        return store
    from cas.blobstore.retry import RetryingBlobStore
    from cas.blobstore.s3 import S3BlobStore

    if isinstance(store, S3BlobStore) and not readonly:
        store.check_bucket()
        # The first supports_conditional_writes probes the server (three small requests).
        if shared_writer and not store.supports_conditional_writes:
            raise CASError(
                f"S3 endpoint {store.endpoint_url} ignores conditional writes (If-None-Match/"
                f"If-Match), so concurrent writers to {store.url} could overwrite each other's "
                "ref updates and delta chunks; use a server that enforces them (AWS S3, "
                "SeaweedFS, MinIO), or open with single_writer=True if only one process ever "
                "writes this store"
            )
    return RetryingBlobStore(store)
