"""Content digests: blake3 over decoded bytes, the identity of every stored object."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NewType

import blake3

from cas.errors import FormatError

Digest = NewType("Digest", str)
"""A lowercase 64-character hex blake3 digest."""

DIGEST_BYTES = 32
_HEX_RE = re.compile(r"[0-9a-f]{64}\Z")
# blake3 parallelises internally above this size; below it threads cost more than they save.
_MULTITHREAD_THRESHOLD = 8 << 20


def digest_of(data: bytes | bytearray | memoryview) -> Digest:
    """Return the blake3 digest of ``data``."""
    threads = blake3.blake3.AUTO if len(data) >= _MULTITHREAD_THRESHOLD else 1
    return Digest(blake3.blake3(data, max_threads=threads).hexdigest())


def digest_of_parts(parts: Sequence[bytes | bytearray | memoryview]) -> Digest:
    """Return the blake3 digest of the concatenation of ``parts``."""
    total = sum(memoryview(part).nbytes for part in parts)
    threads = blake3.blake3.AUTO if total >= _MULTITHREAD_THRESHOLD else 1
    hasher = blake3.blake3(max_threads=threads)
    for part in parts:
        hasher.update(part)
    return Digest(hasher.hexdigest())


def parse_digest(text: str | bytes) -> Digest:
    """Validate ``text`` (hex string or 32 raw bytes) and return it as a Digest."""
    if isinstance(text, bytes):
        if len(text) != DIGEST_BYTES:
            raise FormatError(f"digest must be {DIGEST_BYTES} bytes, got {len(text)}")
        return Digest(text.hex())
    if not _HEX_RE.match(text):
        raise FormatError(f"not a blake3 hex digest: {text[:80]!r}")
    return Digest(text)


def digest_to_bytes(digest: Digest) -> bytes:
    """The 32 raw bytes of a digest, as stored in manifests."""
    return bytes.fromhex(digest)


class StreamHasher:
    """Incremental blake3 over a stream of writes."""

    def __init__(self) -> None:
        self._hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Feed more bytes."""
        self._hasher.update(data)

    def digest(self) -> Digest:
        """The digest of everything fed so far."""
        return Digest(self._hasher.hexdigest())
