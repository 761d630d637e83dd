"""Blob stores: the storage backends cas runs on, and ``open_blobstore`` to pick one by URL."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cas.blobstore.base import BlobInfo, BlobStore, Version, check_key
from cas.blobstore.local import LocalBlobStore
from cas.blobstore.memory import MemoryBlobStore
from cas.blobstore.readonly import ReadOnlyBlobStore
from cas.errors import NotFound

__all__ = [
    "BlobInfo",
    "BlobStore",
    "LocalBlobStore",
    "MemoryBlobStore",
    "ReadOnlyBlobStore",
    "Version",
    "check_key",
    "open_blobstore",
]


def open_blobstore(url: str | os.PathLike[str], **options: Any) -> BlobStore:
    """Open the blob store a URL names: a path, ``file://``, ``memory://``, ``s3://`` or fsspec."""
    text = os.fspath(url)
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
