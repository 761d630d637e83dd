"""SealedBlobStore: client-side encryption under every layer above the blob store.

Each blob but the store's ``config`` and its wrapped keys (``keys/``) is sealed with AES-256-GCM
under a payload key, with a fresh random 96-bit nonce per write and the blob's (outer) key as
associated data, so a ciphertext moved to another name fails its tag. A sealed blob is
``MAGIC | version | nonce | ciphertext+tag``.

Version 2 is a chunk sealed before its name is known (``put_if_absent_named``): a save writes a
new chunk while its hash is computed, as a plain store's does (``cas.objects.overlap``), so the
name cannot be in the associated data, which is ``NAMED_AAD`` instead. Such a blob moved under
another object's name still decrypts there, and then fails the digest check every read of an
object makes (invariant 2): the name is bound by the content instead of the tag. A version-2
blob anywhere but under an object's name (a ref, a lease) is refused.

Object names hide their content: ``chunks/<d[:2]>/<d>`` (``d`` the blake3 of the plaintext) is
stored as ``chunks/<n[:2]>/<n>`` where ``n`` is ``d`` encrypted with AES-256 under a name key, a
keyed pseudorandom permutation. Equal plaintext still gets one name, so dedup holds within the
store and between stores sharing the key; without the key a name says nothing of the content.
Unlike a keyed hash, the permutation can be inverted by the key's holder, so listings (GC's
mark and sweep, inventories, ``cas verify``) still name objects by their plain digest without
an index to keep in step. Everything above sees plain keys and bytes, and the object layer still
checks every byte against its digest after the tag (invariant 2).

Local files beneath this wrapper hold ciphertext under other names, so ``local_root`` is None:
no reader maps them and no sweep renames them. A chunk's file is still read where it lies
(``read_into_buffers``): straight into the reader's buffers, and decrypted there.
"""

from __future__ import annotations

import copy
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cas.blobstore.base import (
    BlobInfo,
    BlobStore,
    BytesLike,
    Payload,
    Version,
    joined,
    parts_of,
)
from cas.blobstore.bulk import read_into
from cas.blobstore.cache import CachingBlobStore
from cas.blobstore.direct import huge_page_region
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import FormatError, IntegrityError

MAGIC = b"CASs"
SEAL_VERSION = 1
NAMED_VERSION = 2
NAMED_AAD = b"cas 2026-11-28 object sealed before its name"
"""Associated data of a version-2 blob (see the module's docstring)."""
NONCE_SIZE = 12
TAG_SIZE = 16
HEADER_SIZE = len(MAGIC) + 1 + NONCE_SIZE
OVERHEAD = HEADER_SIZE + TAG_SIZE
"""Bytes a sealed blob holds beyond its plaintext."""
CLEAR_KEYS = ("config",)
CLEAR_PREFIXES = ("keys/",)
"""Blobs a reader needs before it has the key: the store's settings and its wrapped keys."""
OBJECT_ROOTS = ("chunks/", "manifests/")
MAX_SCRATCH = (64 << 20) + (64 << 10)
"""The largest sealed blob read through a buffer of the pool (a full-size chunk)."""
_OBJECT_KEY = re.compile(r"(chunks|manifests)/([0-9a-f]{2})/(\2[0-9a-f]{62})\Z")
NAME_CONTEXT = "cas 2026-11-28 object names"
PAYLOAD_CONTEXT = "cas 2026-11-28 payloads"


@dataclass(frozen=True)
class StoreKey:
    """A store's 32-byte master key and the two subkeys derived from it (blake3 derive_key)."""

    master: bytes

    def __post_init__(self) -> None:
        if len(self.master) != 32:
            raise FormatError("a store's master key is 32 bytes")

    def subkey(self, context: str) -> bytes:
        """The subkey for one purpose; keys for different purposes are independent."""
        return blake3.blake3(self.master, derive_key_context=context).digest(32)

    @classmethod
    def generate(cls) -> StoreKey:
        """A new random master key."""
        return cls(os.urandom(32))


class BufferPool:
    """Page-aligned buffers that sealed blobs pass through on their way to and from storage,
    shared by every sealed store and thread of the process, and kept up to ``keep`` bytes.

    Fresh memory for each blob, or for each store or thread a process opens (a repository's
    workers are its own), would cost a page fault for every page written through it: on this
    kind of machine far more than the AES itself.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[tuple[mmap.mmap, memoryview]] = []
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, size: int) -> Iterator[memoryview]:
        """A buffer of at least ``size`` bytes, this caller's until the block ends. Buffers are
        in huge pages where the kernel has them (``huge_page_region``): a sealed chunk written
        past the page cache from one reaches the disk in fewer, larger requests."""
        with self._lock:
            fits = [held for held in self._free if len(held[1]) >= size]
            held = min(fits, key=lambda fit: len(fit[1])) if fits else None
            if held is not None:
                self._free.remove(held)
        if held is None:
            length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
            mapping, start = huge_page_region(length, populate=True)
            held = (mapping, memoryview(mapping)[start : start + length])
        try:
            yield held[1]
        finally:
            with self._lock:
                if sum(len(view) for _, view in self._free) + len(held[1]) <= self.keep:
                    self._free.append(held)


BUFFERS = BufferPool(keep=64 << 20)
"""The process's pool: room for a full-size chunk, or for twelve workers' default-size ones."""


def _fresh_pool_in_child() -> None:
    """A forked child starts with an empty pool and a lock of its own: the parent's may have
    been held by another thread at the fork, and would never be released there."""
    BUFFERS._free, BUFFERS._lock = [], threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_pool_in_child)


def sealed_store(blobs: BlobStore, key: StoreKey) -> BlobStore:
    """``blobs`` sealed under ``key``. A local cache in front of a remote (``cache=``) is sealed
    on its own, so it holds ciphertext under hidden names too and checks plaintext as it fills."""
    if isinstance(blobs, CachingBlobStore):
        return blobs.rewrapped(lambda inner: SealedBlobStore(inner, key))
    return SealedBlobStore(blobs, key)


class SealedBlobStore(BlobStoreWrapper):
    """Encrypts names and payloads on their way to ``inner``; decrypts and checks on the way back."""

    def __init__(self, inner: BlobStore, key: StoreKey) -> None:
        super().__init__(inner)
        self._key = key
        self._payload_key = key.subkey(PAYLOAD_CONTEXT)
        self._aead = AESGCM(self._payload_key)
        self._names = Cipher(algorithms.AES(key.subkey(NAME_CONTEXT)), modes.ECB())

    def same_key(self, other: SealedBlobStore) -> bool:
        """Whether ``other`` seals with this store's key: then its stored objects are valid
        here as they are (``cas.blobstore.copier``)."""
        return self._key == other._key

    # -- names --------------------------------------------------------------------------------

    def stored_key(self, key: str) -> str:
        """The key ``key`` is stored under in ``inner`` (an object's name encrypted)."""
        match = _OBJECT_KEY.fullmatch(key)
        if match is None:
            return key
        encryptor = self._names.encryptor()
        name = (encryptor.update(bytes.fromhex(match.group(3))) + encryptor.finalize()).hex()
        return f"{match.group(1)}/{name[:2]}/{name}"

    def _outer_key(self, stored: str) -> str:
        match = _OBJECT_KEY.fullmatch(stored)
        if match is None:
            return stored
        decryptor = self._names.decryptor()
        digest = (decryptor.update(bytes.fromhex(match.group(3))) + decryptor.finalize()).hex()
        return f"{match.group(1)}/{digest[:2]}/{digest}"

    # -- payloads -----------------------------------------------------------------------------

    @staticmethod
    def _clear(key: str) -> bool:
        return key in CLEAR_KEYS or key.startswith(CLEAR_PREFIXES)

    def seal(
        self, key: str | None, data: Payload, into: memoryview | None = None
    ) -> list[BytesLike]:
        """The sealed form of ``data`` stored under ``key``, as parts a store writes in turn;
        ``key`` None seals an object whose name is not known yet (version 2, ``NAMED_AAD``).

        The parts of a payload (a chunk's header and its bytes) are encrypted one after the
        other into one buffer, ``into`` (at least ``OVERHEAD`` bytes more than ``data``) or a new
        one, so sealing costs one pass and no join of the plaintext. A page-aligned ``into``
        lets a direct write (``cas.blobstore.direct``) send the sealed blob from where it lies.
        """
        parts = parts_of(data)
        if key is not None and self._clear(key):
            return list(parts)
        nonce = os.urandom(NONCE_SIZE)
        encryptor = Cipher(algorithms.AES(self._payload_key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(NAMED_AAD if key is None else key.encode())
        size = sum(memoryview(p).nbytes for p in parts)
        view = into if into is not None else memoryview(bytearray(size + OVERHEAD))
        version = NAMED_VERSION if key is None else SEAL_VERSION
        view[:HEADER_SIZE] = MAGIC + bytes([version]) + nonce
        at = HEADER_SIZE
        for part in parts:
            plain = memoryview(part).cast("B")
            at += encryptor.update_into(plain, view[at : at + len(plain)])
        encryptor.finalize()
        view[at : at + TAG_SIZE] = encryptor.tag
        # Two parts, as a plain chunk's header and payload are: one buffered write of a whole
        # chunk into a new file cost the kernel 2-3x the CPU of a short write and then the rest
        # (Linux 6.18, ext4: an encrypted 1 GiB save spent 1.2-1.8 s of CPU in its local
        # writes, a plain one 0.35 s). A direct write sends the second part from where it lies.
        return [view[:HEADER_SIZE], view[HEADER_SIZE : at + TAG_SIZE]]

    @contextmanager
    def _sealing(self, key: str | None, data: Payload) -> Iterator[list[BytesLike]]:
        """``seal``, in a buffer of the process's pool (``BUFFERS``) held until the block ends,
        when the store below has written the parts."""
        if key is not None and self._clear(key):
            yield list(parts_of(data))
            return
        size = sum(memoryview(p).nbytes for p in parts_of(data)) + OVERHEAD
        with BUFFERS.lease(size) as buffer:
            yield self.seal(key, data, buffer)

    def unseal(self, key: str, blob: bytes | memoryview) -> bytes:
        """The plaintext of a sealed blob; IntegrityError when it is not one or was altered."""
        if self._clear(key):
            return bytes(blob)
        nonce, associated = self._header(key, blob, len(blob))
        try:
            return self._aead.decrypt(nonce, memoryview(blob)[HEADER_SIZE:], associated)
        except InvalidTag as e:
            raise self._altered(key) from e

    def _header(self, key: str, head: bytes | memoryview, size: int) -> tuple[bytes, bytes]:
        """The nonce in ``head``, the start of a sealed blob of ``size`` bytes, and the
        associated data its version says, once its magic and version are checked."""
        if size < OVERHEAD or bytes(head[: len(MAGIC)]) != MAGIC:
            raise IntegrityError(f"{key} in {self.url} is not sealed with this store's key")
        version = head[len(MAGIC)]
        if version == NAMED_VERSION and _OBJECT_KEY.fullmatch(key) is None:
            raise IntegrityError(f"{key} in {self.url} holds a sealed object, not its own blob")
        if version not in (SEAL_VERSION, NAMED_VERSION):
            raise FormatError(f"{key} in {self.url}: unknown seal version {version}")
        associated = NAMED_AAD if version == NAMED_VERSION else key.encode()
        return bytes(head[len(MAGIC) + 1 : HEADER_SIZE]), associated

    def _altered(self, key: str) -> IntegrityError:
        return IntegrityError(
            f"{key} in {self.url} fails its authentication tag (altered, or another key)"
        )

    # -- BlobStore ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        stored = self.stored_key(key)
        path = None if self._clear(key) else self.inner.local_path(stored)
        if path is not None and (size := _file_size(path)) is not None and size <= MAX_SCRATCH:
            with BUFFERS.lease(size + 1) as view:
                got = read_into(self.inner, stored, 0, [view[: size + 1]])
                if got <= size:  # the whole blob (one that grew meanwhile is read the plain way)
                    return self.unseal(key, view[:got])
        return self.unseal(key, self.inner.get(stored))

    def read_into_buffers(self, key: str, start: int, outs: Sequence[memoryview]) -> int | None:
        """A sealed object whose file lies on this machine, read straight into ``outs`` and
        decrypted there; the plaintext bytes (fewer than ``outs`` hold only when it is shorter).
        None (read it another way) for a read from an offset, a blob larger than ``outs`` (its
        tag covers the whole of it), a clear blob, or a store below without local files.

        One ``preadv`` puts the seal's header and tag into side buffers and the ciphertext into
        ``outs``, as a plain load reads a chunk; AES-GCM then decrypts ``outs`` in place, so a
        sealed load costs a plain one's read plus one pass of AES (a stream mode in place:
        OpenSSL's supported full overlap). Reading into a pool buffer and decrypting from there
        cost one more pass over the bytes (a 1 GiB load: 0.155 s against 0.12 s plain), and a
        spill buffer one more again (0.19 s; docs/format.md). A blob shorter than ``outs`` is
        read again the pooled way. ``outs`` hold unchecked bytes after an error, as after any
        failed read.
        """
        if start or self._clear(key):
            return None
        stored = self.stored_key(key)
        if self.inner.local_path(stored) is None:
            return None
        wanted = sum(len(out) for out in outs)
        head, tail = memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(TAG_SIZE + 1))
        got = read_into(self.inner, stored, 0, [head, *outs, tail])
        if got > OVERHEAD + wanted:
            return None
        if got < OVERHEAD + wanted:
            return self._read_pooled(key, stored, outs)
        return self._decrypt_into(key, head, outs, bytes(tail[:TAG_SIZE]), got)

    def _read_pooled(self, key: str, stored: str, outs: Sequence[memoryview]) -> int | None:
        """``read_into_buffers`` through a buffer of the pool, for a blob that may be shorter
        than ``outs``: its tag is wherever its end falls."""
        wanted = sum(len(out) for out in outs)
        with BUFFERS.lease(OVERHEAD + wanted + 1) as whole:
            blob = whole[: OVERHEAD + wanted + 1]
            got = read_into(self.inner, stored, 0, [blob])
            if got > OVERHEAD + wanted:
                return None
            size = max(0, got - OVERHEAD)
            tag = bytes(blob[HEADER_SIZE + size : HEADER_SIZE + size + TAG_SIZE])
            body = blob[HEADER_SIZE : HEADER_SIZE + size]
            return self._decrypt_into(key, blob[:got], outs, tag, got, body)

    def _decrypt_into(
        self,
        key: str,
        head: memoryview,
        outs: Sequence[memoryview],
        tag: bytes,
        got: int,
        source: memoryview | None = None,
    ) -> int:
        """Decrypt a blob of ``got`` sealed bytes into ``outs``, from ``source`` or (None) in
        place, from the ciphertext ``outs`` already hold; the plaintext size once the tag is
        checked."""
        nonce, associated = self._header(key, head, got)
        size = got - OVERHEAD
        decryptor = Cipher(algorithms.AES(self._payload_key), modes.GCM(nonce, tag)).decryptor()
        decryptor.authenticate_additional_data(associated)
        at, left = 0, size
        for out in outs:
            n = min(len(out), left)
            if n:
                data = out[:n] if source is None else source[at : at + n]
                decryptor.update_into(data, out[:n])
            at += n
            left -= n
        try:
            decryptor.finalize()
        except InvalidTag as e:
            raise self._altered(key) from e
        return size

    def for_background_writes(self) -> BlobStore:
        """Sealed too, over the store below's background handle (a local store's direct
        writes): a training loop's encrypted saves keep the plain ones' path past the page
        cache, the sealed blob sent from this thread's aligned buffer where it lies."""
        inner = self.inner.for_background_writes()
        if inner is self.inner:
            return self
        handle = copy.copy(self)
        handle.inner = inner
        return handle

    @property
    def reads_in_place(self) -> bool:
        """Where the store below has local files: objects are decrypted straight from them into
        a reader's buffers (``read_into_buffers``)."""
        return self.inner.reads_in_place

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get(key)[start:end]  # a tag covers the whole blob: read it whole

    def _size(self, key: str, stored: int) -> int:
        """The size of the blob as put (what ``stat`` promises), from its sealed size."""
        return stored if self._clear(key) else max(0, stored - OVERHEAD)

    def stat(self, key: str) -> BlobInfo:
        info = self.inner.stat(self.stored_key(key))
        return BlobInfo(key, self._size(key, info.size), info.mtime)

    def has(self, key: str) -> bool:
        return self.inner.has(self.stored_key(key))

    def list_info(self, prefix: str = "") -> Iterator[BlobInfo]:
        # An object's stored name sorts elsewhere than its plain one. A prefix above the object
        # roots lists the same blobs either way; one inside a root lists that root and filters.
        inside = [r for r in OBJECT_ROOTS if prefix.startswith(r)]
        listed = inside[0] if inside else prefix
        for info in self.inner.list_info(listed):
            key = self._outer_key(info.key)
            if key.startswith(prefix):
                yield BlobInfo(key, self._size(key, info.size), info.mtime)

    def list(self, prefix: str = "") -> Iterator[str]:
        return (info.key for info in self.list_info(prefix))

    def put(self, key: str, data: Payload) -> None:
        with self._sealing(key, data) as sealed:
            self.inner.put(self.stored_key(key), sealed)

    def put_if_absent_named(self, key_of: Callable[[], str], data: Payload) -> bool:
        """``put_if_absent`` under ``key_of()``. An object is sealed before its name is asked
        for (version 2), so a local store below writes its temp file while the caller's hash
        runs, as a plain store's save does; any other blob is sealed again under its name once
        that is known (a temp file written for nothing: no caller of this store does so)."""

        def stored() -> str:
            key = key_of()
            if _OBJECT_KEY.fullmatch(key) is None:
                raise _NotAnObject(key)
            return self.stored_key(key)

        try:
            with self._sealing(None, data) as sealed:
                return self.inner.put_if_absent_named(stored, sealed)
        except _NotAnObject as e:
            return self.put_if_absent(e.key, data)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        with self._sealing(key, data) as sealed:
            return self.inner.put_if_absent(self.stored_key(key), sealed)

    def put_transient(self, key: str, data: BytesLike) -> None:
        with self._sealing(key, data) as sealed:
            self.inner.put_transient(self.stored_key(key), joined(sealed))

    def touch(self, key: str) -> None:
        self.inner.touch(self.stored_key(key))

    def delete(self, key: str) -> None:
        self.inner.delete(self.stored_key(key))

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        blob, version = self.inner.get_versioned(self.stored_key(key))
        return self.unseal(key, blob), version

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        with self._sealing(key, data) as parts:
            sealed = joined(parts)
        return self.inner.put_conditional(self.stored_key(key), sealed, expected)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self.inner.delete_conditional(self.stored_key(key), expected)

    def drop_cached(self, key: str) -> bool:
        return self.inner.drop_cached(self.stored_key(key))

    @property
    def local_root(self) -> Path | None:
        return None  # ciphertext under other names: never mapped as it is, never renamed

    @property
    def supports_rename(self) -> bool:
        return False


class _NotAnObject(Exception):
    """A blob written through ``put_if_absent_named`` turned out to be no object: it is sealed
    again under its name."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _file_size(path: Path) -> int | None:
    """The size of a local blob's file, or None when it cannot be stat'ed (then the store's
    own ``get`` says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return None
