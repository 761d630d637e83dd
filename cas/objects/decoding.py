"""Decoding a stored object through its delta chain: the chain walked by headers, then decoded
from its standalone root up, into a new buffer or straight into the caller's."""

from __future__ import annotations

from cas.blobstore.base import BlobStore
from cas.codecs import codec_by_id
from cas.digest import Digest
from cas.errors import FormatError, IntegrityError, NotFound
from cas.objects.envelope import HEADER_SIZE, MAX_PARAMS, Envelope, decode_level, parse_envelope
from cas.objects.keys import ObjectKind, object_key

MAX_DELTA_DEPTH = 64
"""A base chain deeper than this is treated as corrupt (a cycle or a hostile store)."""


class OtherSize(Exception):
    """A stored chunk declares another size than the buffer it was to be decoded into."""


def stored_bound(size: int) -> int:
    """More than any codec cas writes stores a chunk of ``size`` decoded bytes in (parameters
    aside): an incompressible chunk is stored as it is, with a little framing."""
    return size + size // 64 + 4096


def _no_base(digest: Digest) -> bytes:
    raise FormatError(f"a standalone chunk asked for delta base {digest}")


def _chunk_key(digest: Digest) -> str:
    return object_key(ObjectKind.CHUNK, digest)


class ChainDecoder:
    """Decodes stored objects of one store, reading their delta bases from it; nothing here
    verifies digests (the object store hashes what it returns)."""

    def __init__(self, blobs: BlobStore, max_object_size: int) -> None:
        self.blobs = blobs
        self.max_object_size = max_object_size

    def decode(
        self, digest: Digest, blob: bytes | bytearray, noun: str = "chunk"
    ) -> bytes | memoryview:
        """The decoded bytes of a stored object, unverified; a delta is rebuilt from the bottom of
        its base chain up. ``noun`` names the object in errors (a manifest is decoded here too).

        The chain is walked by headers first (``base_chain``), refusing loops, chains deeper
        than MAX_DELTA_DEPTH and bases of another size, so nothing is decompressed for a chain
        that cannot be rebuilt. Each level is then decoded on the one below, so a read
        holds one base, one payload and one result at a time, however deep the chain.
        """
        try:
            envelope = parse_envelope(blob, self.max_object_size)
            chain, root = self.base_chain(digest, envelope)
            below: tuple[Digest, bytes | memoryview] | None = None
            for base in reversed(chain):
                base_blob = root if root is not None else self._base_blob(base)
                root = None
                base_envelope = parse_envelope(base_blob, self.max_object_size)
                below = (base, decode_level(base_envelope, base_blob, below))
                del base_blob  # only the decoded base is needed from here up
            return decode_level(envelope, blob, below)
        except FormatError as e:
            raise IntegrityError(f"{noun} {digest} is corrupt: {e}") from e

    def decode_into(self, digest: Digest, blob: bytes | bytearray, out: memoryview) -> None:
        """``decode`` straight into ``out``, unverified: the bottom of the chain is decoded into
        ``out`` and each delta above it is folded in place, so no level needs a buffer of its
        own beyond the delta being applied. ``OtherSize`` if the chunk is not ``len(out)``
        bytes (before anything is read or decoded)."""
        try:
            envelope = parse_envelope(blob, self.max_object_size)
            if envelope.decoded_size != len(out):
                raise OtherSize
            chain, root = self.base_chain(digest, envelope)
            levels = [*reversed(chain), digest]
            for depth, level in enumerate(levels):
                if level == digest:
                    level_blob = blob
                else:
                    level_blob = root if root is not None else self._base_blob(level)
                    root = None
                level_envelope = parse_envelope(level_blob, self.max_object_size)
                codec = codec_by_id(level_envelope.codec_id)
                payload = memoryview(level_blob)[level_envelope.payload_offset :]
                if level_envelope.decoded_size != len(out):
                    raise FormatError(f"delta base {level} is not the size its chain said")
                base = codec.base_of(level_envelope.params)
                # The headers walked before named this chain; a blob rewritten since names another.
                if base != (levels[depth - 1] if depth else None):
                    raise FormatError(f"delta base {base} is not the one its chain named")
                if base is None:
                    codec.decode_into(level_envelope.params, payload, out, _no_base)
                else:
                    codec.apply_into(level_envelope.params, payload, out)
                del level_blob, payload
        except FormatError as e:
            raise IntegrityError(f"chunk {digest} is corrupt: {e}") from e

    def _base_blob(self, base: Digest) -> bytes:
        try:
            return self.blobs.get(_chunk_key(base))
        except NotFound as e:
            raise IntegrityError(f"delta base {base} is missing from the store") from e

    def base_chain(self, digest: Digest, envelope: Envelope) -> tuple[list[Digest], bytes | None]:
        """The bases a stored object needs, nearest first, from their headers alone; and the
        stored bytes of the last one (the chain's standalone root) when they came whole with
        its header.

        Where blobs are local files, each hop reads at most what a chunk of this size can take
        up when stored, so the root, which every load of a delta needs, is not opened twice; a
        larger blob (or one of a longer chain's middle levels) is read again when it is decoded.
        Elsewhere a hop reads the header only: a ranged read may be a request to a remote, or
        bypass a cache (``cas.blobstore.cache``) whose copy ``decode`` must read and check.
        """
        chain: list[Digest] = []
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        keep_root = self.blobs.reads_in_place
        limit = HEADER_SIZE + MAX_PARAMS
        if keep_root:
            limit += stored_bound(envelope.decoded_size)
        head = b""
        while base is not None:
            if base == digest or base in chain or len(chain) >= MAX_DELTA_DEPTH:
                raise IntegrityError(
                    f"chunk {digest}: delta chain loops or is deeper than {MAX_DELTA_DEPTH}"
                )
            chain.append(base)
            try:
                head = self.blobs.get_range(_chunk_key(base), 0, limit)
            except NotFound as e:
                raise IntegrityError(f"delta base {base} is missing from the store") from e
            found = parse_envelope(head, self.max_object_size)
            if found.decoded_size != envelope.decoded_size:
                raise FormatError(
                    f"delta base {base} holds {found.decoded_size} bytes, "
                    f"the chunk {envelope.decoded_size}"
                )
            base = codec_by_id(found.codec_id).base_of(found.params)
        return chain, (head if keep_root and chain and len(head) < limit else None)
