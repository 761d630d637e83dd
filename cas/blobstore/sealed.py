"""SealedBlobStore: client-side encryption under every layer above the blob store.

Each blob but the store's ``config`` and its wrapped keys (``keys/``) is sealed with AES-256-GCM
under a payload key, with a fresh random 96-bit nonce per write and the blob's (outer) key as
associated data, so a ciphertext moved to another name fails its tag. A sealed blob is
``MAGIC | version | nonce | ciphertext+tag``.

Object names hide their content: ``chunks/<d[:2]>/<d>`` (``d`` the blake3 of the plaintext) is
stored as ``chunks/<n[:2]>/<n>`` where ``n`` is ``d`` encrypted with AES-256 under a name key, a
keyed pseudorandom permutation. Equal plaintext still gets one name, so dedup holds within the
store and between stores sharing the key; without the key a name says nothing of the content.
Unlike a keyed hash, the permutation can be inverted by the key's holder, so listings (GC's
mark and sweep, inventories, ``cas verify``) still name objects by their plain digest without
an index to keep in step. Everything above sees plain keys and bytes, and the object layer still
checks every byte against its digest after the tag (invariant 2).

Local files are never read or renamed in place beneath this wrapper: ``local_root`` is None.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
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
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.errors import FormatError, IntegrityError

MAGIC = b"CASs"
SEAL_VERSION = 1
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
"""The largest sealed blob read through a thread's reusable buffer (a full-size chunk)."""
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


class SealedBlobStore(BlobStoreWrapper):
    """Encrypts names and payloads on their way to ``inner``; decrypts and checks on the way back."""

    def __init__(self, inner: BlobStore, key: StoreKey) -> None:
        super().__init__(inner)
        self._local = threading.local()
        self._payload_key = key.subkey(PAYLOAD_CONTEXT)
        self._aead = AESGCM(self._payload_key)
        self._names = Cipher(algorithms.AES(key.subkey(NAME_CONTEXT)), modes.ECB())

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

    def seal(self, key: str, data: Payload) -> list[BytesLike]:
        """The sealed form of ``data`` stored under ``key``, as parts a store writes in turn.

        The parts of a payload (a chunk's header and its bytes) are encrypted one after the
        other into one buffer, so sealing costs one pass and no join of the plaintext.
        """
        parts = parts_of(data)
        if self._clear(key):
            return list(parts)
        nonce = os.urandom(NONCE_SIZE)
        encryptor = Cipher(algorithms.AES(self._payload_key), modes.GCM(nonce)).encryptor()
        encryptor.authenticate_additional_data(key.encode())
        view, at = self._scratch(sum(len(memoryview(p).cast("B")) for p in parts) + 15), 0
        for part in parts:
            at += encryptor.update_into(memoryview(part).cast("B"), view[at:])
        encryptor.finalize()
        return [MAGIC + bytes([SEAL_VERSION]) + nonce, view[:at], encryptor.tag]

    def unseal(self, key: str, blob: bytes | memoryview) -> bytes:
        """The plaintext of a sealed blob; IntegrityError when it is not one or was altered."""
        if self._clear(key):
            return bytes(blob)
        if len(blob) < OVERHEAD or bytes(blob[: len(MAGIC)]) != MAGIC:
            raise IntegrityError(f"{key} in {self.url} is not sealed with this store's key")
        if blob[len(MAGIC)] != SEAL_VERSION:
            raise FormatError(f"{key} in {self.url}: unknown seal version {blob[len(MAGIC)]}")
        nonce = bytes(blob[len(MAGIC) + 1 : HEADER_SIZE])
        try:
            return self._aead.decrypt(nonce, memoryview(blob)[HEADER_SIZE:], key.encode())
        except InvalidTag as e:
            raise IntegrityError(
                f"{key} in {self.url} fails its authentication tag (altered, or another key)"
            ) from e

    # -- BlobStore ----------------------------------------------------------------------------

    def _scratch(self, size: int) -> memoryview:
        """This thread's buffer of at least ``size`` bytes, kept for its next blob.

        Ciphertext only passes through it: a put hands it to the store below, which has
        written it when the call returns, and a read decrypts out of it into new bytes. Fresh
        memory for every chunk would cost page faults worth more than the AES itself.
        """
        buffer: bytearray | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = bytearray(max(size, 2 * len(buffer or b"")))
            self._local.buffer = buffer
        return memoryview(buffer)

    def get(self, key: str) -> bytes:
        stored = self.stored_key(key)
        path = None if self._clear(key) else self.inner.local_path(stored)
        if path is not None and (size := _file_size(path)) is not None and size <= MAX_SCRATCH:
            view = self._scratch(size + 1)
            got = read_into(self.inner, stored, 0, [view[: size + 1]])
            if got <= size:  # the whole blob (one that grew meanwhile is read the plain way)
                return self.unseal(key, view[:got])
        return self.unseal(key, self.inner.get(stored))

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
        self.inner.put(self.stored_key(key), self.seal(key, data))

    def put_if_absent(self, key: str, data: Payload) -> bool:
        return self.inner.put_if_absent(self.stored_key(key), self.seal(key, data))

    def put_transient(self, key: str, data: BytesLike) -> None:
        self.inner.put_transient(self.stored_key(key), joined(self.seal(key, data)))

    def touch(self, key: str) -> None:
        self.inner.touch(self.stored_key(key))

    def delete(self, key: str) -> None:
        self.inner.delete(self.stored_key(key))

    def get_versioned(self, key: str) -> tuple[bytes, Version]:
        blob, version = self.inner.get_versioned(self.stored_key(key))
        return self.unseal(key, blob), version

    def put_conditional(self, key: str, data: BytesLike, expected: Version | None) -> Version:
        sealed = joined(self.seal(key, data))
        return self.inner.put_conditional(self.stored_key(key), sealed, expected)

    def delete_conditional(self, key: str, expected: Version) -> None:
        self.inner.delete_conditional(self.stored_key(key), expected)

    def drop_cached(self, key: str) -> bool:
        return self.inner.drop_cached(self.stored_key(key))

    @property
    def local_root(self) -> Path | None:
        return None  # files beneath hold ciphertext under other names: never read in place

    @property
    def supports_rename(self) -> bool:
        return False


def _file_size(path: Path) -> int | None:
    """The size of a local blob's file, or None when it cannot be stat'ed (then the store's
    own ``get`` says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return None
