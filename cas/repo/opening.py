"""Opening a store: where the default one lives, and which wrappers a location gets."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cas.blobstore import BlobStore, LocalBlobStore, ReadOnlyBlobStore, open_for_use
from cas.blobstore.appendonly import APPEND_ONLY_SECTION, AppendOnlyBlobStore
from cas.errors import AlreadyExists, CASError, IntegrityError, NotFound
from cas.objects.encoding import DeltaSettings
from cas.objects.keys import parse_object_key
from cas.objects.store import ObjectStore
from cas.repo.config import StoreConfig, read_config, write_config
from cas.repo.keys import (
    ENCRYPTION_SECTION,
    SCHEME,
    KeyRequired,
    add_slot,
    open_key,
    passphrase_from_environment,
)
from cas.repo.repository import Repository

if TYPE_CHECKING:
    from cas.blobstore.sealed import StoreKey

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
    ``NotFound``. ``config`` is what a new store is made with: a store's settings are stored in
    it and shared by every process, so for an existing store a ``config`` that asks for other
    settings is ``AlreadyExists`` naming them (``Repository.update_settings`` changes the writer
    settings; chunking is fixed), never silently ignored.

    Remote stores (S3, fsspec) retry transient failures with backoff. ``cache="/dir"`` fronts a
    remote with a local cache of chunks and manifests (``cas.blobstore.cache``). Opening an S3 store for
    writing probes for conditional writes and refuses a server without them, unless
    ``single_writer=True`` says no other process writes it. ``filesystem=`` (an fsspec
    filesystem, such as an ``s3fs.S3FileSystem`` configured elsewhere) opens ``url`` as a path
    on that filesystem (``cas.blobstore.fsspec_store``). ``read_limits=`` (``cas.ReadLimits``)
    caps what one read allocates, whatever a manifest declares (default: from the environment).

    An encrypted store (``cas.repo.keys``, ``cas.blobstore.sealed``) opens with ``key=`` (its
    passphrase; else ``CAS_KEY``, ``CAS_KEY_FILE``, ``CAS_KEY_COMMAND``); a new store at ``url`` is
    created encrypted when ``key=`` or ``encrypt=True`` is given, with the master key of
    ``key_from=`` (another encrypted Repository) to share dedup with it. ``append_only=True`` (or
    ``CAS_APPEND_ONLY=1``, or a store created so) opens a handle that refuses forget, gc and rm.
    """
    cache = options.pop("cache", None)
    read_limits = options.pop("read_limits", None)
    single_writer = bool(options.pop("single_writer", False))
    key: str | None = options.pop("key", None)
    encrypt = bool(options.pop("encrypt", False))
    key_from: Repository | None = options.pop("key_from", None)
    append_only = bool(options.pop("append_only", False)) or os.environ.get(
        "CAS_APPEND_ONLY", ""
    ).strip().lower() in ("1", "true", "yes")
    blobs = open_for_use(
        url if url is not None else default_store_url(),
        shared_writer=not (readonly or single_writer),
        readonly=readonly,
        **options,
    )
    if cache is not None:
        from cas.blobstore.cache import CachingBlobStore

        blobs = CachingBlobStore(
            LocalBlobStore(Path(cache).expanduser()),
            blobs,
            prefixes=CACHED_PREFIXES,
            verify=verify_cached_object,
        )
    existing = read_config(blobs)
    if existing is None:
        if readonly or not create:
            raise NotFound(f"no cas store at {blobs.url} (create one with `cas init`)")
        existing = replace(config or StoreConfig(), created_at=clock())
        DeltaSettings.from_config(existing.extra)  # refuse bad settings before creating a store
        if encrypt or key is not None:
            shared = key_from.store_key if key_from is not None else None
            if key_from is not None and shared is None:
                raise CASError(f"key_from={key_from.url} is not an encrypted store")
            existing = create_encrypted(blobs, existing, key, shared)
        write_config(blobs, existing)
    elif config is not None and (differ := existing.differences(config)):
        blobs.close()
        raise AlreadyExists(
            f"the store at {blobs.url} holds other settings than config= asks for: "
            f"{', '.join(differ)}; open it without config= to use them, change the writer "
            "settings with Repository.update_settings(...) or extra sections with "
            "Repository.update_config(...); chunk_size and cdc_avg_size are fixed at creation"
        )
    sealed = ENCRYPTION_SECTION in existing.extra
    if sealed:
        try:
            master, slot = open_key(blobs, key)
        except CASError:
            blobs.close()
            raise
        from cas.blobstore.sealed import sealed_store  # with cryptography: encrypted stores only

        blobs = sealed_store(blobs, master)
    elif key is not None or encrypt:
        blobs.close()
        raise CASError(
            f"the store at {blobs.url} is not encrypted; key= and encrypt= only open or create "
            "an encrypted one"
        )
    append_only = append_only or bool(existing.extra.get(APPEND_ONLY_SECTION, False))
    if append_only:
        blobs = AppendOnlyBlobStore(blobs)
    if readonly:
        blobs = ReadOnlyBlobStore(blobs)
    repo = Repository(blobs, existing, clock=clock, read_limits=read_limits)
    if sealed:
        repo.store_key, repo.key_slot = master, slot.id
    return repo


def create_encrypted(
    blobs: BlobStore, config: StoreConfig, passphrase: str | None, master: StoreKey | None = None
) -> StoreConfig:
    """Wrap a new master key (or ``master``, another store's, so the two dedup against each
    other) under ``passphrase`` (else the environment's); return ``config`` marked encrypted
    (the caller writes it, after the key)."""
    passphrase = passphrase if passphrase is not None else passphrase_from_environment()
    if passphrase is None:
        raise KeyRequired(
            f"a passphrase is needed to create an encrypted store at {blobs.url} "
            "(key=, CAS_KEY, CAS_KEY_FILE or CAS_KEY_COMMAND)"
        )
    from cas.blobstore.sealed import StoreKey

    add_slot(blobs, master or StoreKey.generate(), passphrase)
    section = {"scheme": SCHEME, "version": 1}
    return replace(config, extra={**config.extra, ENCRYPTION_SECTION: section})


CACHED_PREFIXES = ("chunks/", "manifests/")
"""What a local cache in front of a remote store holds: objects, whose keys name their content."""
CACHED_OBJECT_MAX = (64 << 20) + 4096
"""The largest object a cache fills from the remote: a full-size chunk and its header."""


def verify_cached_object(through: BlobStore, key: str, blob: bytes) -> None:
    """Raise IntegrityError unless ``blob`` decodes to bytes that hash to the digest ``key`` names.

    A cache calls this on every miss, before it keeps a copy; delta bases are read ``through``
    the cache, so they are verified (and cached) on their way too.
    """
    found = parse_object_key(key)
    if found is None:
        raise IntegrityError(f"{key} in {through.url} is no object")
    kind, digest = found
    ObjectStore(through, max_object_size=CACHED_OBJECT_MAX).verify_stored(kind, digest, blob)
