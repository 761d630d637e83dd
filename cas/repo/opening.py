"""Opening a store: where the default one lives, and which wrappers a location gets."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from cas.blobstore import BlobStore, LocalBlobStore, ReadOnlyBlobStore, open_blobstore
from cas.errors import CASError, NotFound
from cas.objects.encoding import DeltaSettings
from cas.repo.config import StoreConfig, read_config, write_config
from cas.repo.repository import Repository

STORE_ENV = "CAS_STORE"


def default_store_url() -> str:
    """``$CAS_STORE``, else ``$XDG_DATA_HOME/cas/store`` (``~/.local/share/cas/store``)."""
    env = os.environ.get(STORE_ENV)
    if env:
        return env
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return os.path.join(data_home, "cas", "store")


def open(
    url: str | os.PathLike[str] | None = None,
    *,
    create: bool = True,
    readonly: bool = False,
    config: StoreConfig | None = None,
    clock: Callable[[], float] = time.time,
    **options: Any,
) -> Repository:
    """Open (and by default create) the store at ``url``: a path, ``file://``, ``s3://`` or fsspec.

    With no URL: ``$CAS_STORE``, else ``~/.local/share/cas/store``. A location that holds a store of
    another format version is a clear ``FormatError``; a missing store with ``create=False`` is
    ``NotFound``.

    Remote stores (S3, fsspec) retry transient failures with backoff. ``cache="/dir"`` fronts a
    remote with a local cache of chunks and manifests (``cas.blobstore.cache``). Opening an S3 store for
    writing probes for conditional writes and refuses a server without them, unless
    ``single_writer=True`` says no other process writes it.
    """
    cache = options.pop("cache", None)
    single_writer = bool(options.pop("single_writer", False))
    blobs = open_blobstore(url if url is not None else default_store_url(), **options)
    blobs = _guard_remote(blobs, readonly=readonly, single_writer=single_writer)
    if cache is not None:
        from cas.blobstore.cache import CachingBlobStore

        blobs = CachingBlobStore(LocalBlobStore(Path(cache).expanduser()), blobs)
    existing = read_config(blobs)
    if existing is None:
        if readonly or not create:
            raise NotFound(f"no cas store at {blobs.url} (create one with `cas init`)")
        existing = replace(config or StoreConfig(), created_at=clock())
        DeltaSettings.from_config(existing.extra)  # refuse bad settings before creating a store
        write_config(blobs, existing)
    if readonly:
        blobs = ReadOnlyBlobStore(blobs)
    return Repository(blobs, existing, clock=clock)


def _guard_remote(blobs: BlobStore, *, readonly: bool, single_writer: bool) -> BlobStore:
    """Wrap a remote store in retries; refuse S3 writers when the server cannot compare-and-swap."""
    from cas.blobstore import MemoryBlobStore
    from cas.blobstore.retry import RetryingBlobStore

    if isinstance(blobs, (LocalBlobStore, MemoryBlobStore, RetryingBlobStore)):
        return blobs
    from cas.blobstore.s3 import S3BlobStore

    writer = not (readonly or single_writer)
    if isinstance(blobs, S3BlobStore):
        blobs.check_bucket()
    # The first supports_conditional_writes probes the server (three small requests).
    if isinstance(blobs, S3BlobStore) and writer and not blobs.supports_conditional_writes:
        raise CASError(
            f"S3 endpoint {blobs.endpoint_url} ignores conditional writes (If-None-Match/"
            f"If-Match), so concurrent writers to {blobs.url} could overwrite each other's "
            "ref updates and delta chunks; use a server that enforces them (AWS S3, SeaweedFS, "
            "MinIO), or open with single_writer=True if only one process ever writes this store"
        )
    return RetryingBlobStore(blobs)
