"""The object envelope: the header every stored chunk and manifest starts with.

Every stored object is an envelope::

    offset  size  field
    0       4     magic b"CASo"
    4       1     envelope version (1)
    5       1     codec id (cas.codecs; ids are never reused)
    6       2     length P of the codec parameters (u16, little-endian)
    8       8     decoded size (u64, little-endian)
    16      P     codec parameters
    16+P    ...   payload

and is stored under the blake3 digest of its *decoded* bytes, so the key never depends on the
codec. Chunks live under ``chunks/<d[:2]>/<d>``, manifests under ``manifests/<d[:2]>/<d>``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cas.codecs import Codec, codec_by_id
from cas.digest import Digest
from cas.errors import FormatError

OBJECT_MAGIC = b"CASo"
OBJECT_VERSION = 1
HEADER = struct.Struct("<4sBBHQ")
HEADER_SIZE = HEADER.size
MAX_PARAMS = 4096
RAW_CODEC_ID = 0
"""The raw codec's id: a raw chunk's payload is its decoded bytes."""


@dataclass(frozen=True)
class Envelope:
    """A parsed object header."""

    codec_id: int
    decoded_size: int
    params: bytes
    payload_offset: int


def parse_envelope(data: bytes | bytearray | memoryview, max_decoded_size: int) -> Envelope:
    """Parse and bound-check an object header."""
    if len(data) < HEADER_SIZE:
        raise FormatError("object shorter than its header")
    magic, version, codec_id, params_len, decoded_size = HEADER.unpack_from(data, 0)
    if magic != OBJECT_MAGIC:
        raise FormatError("not a cas object (bad magic)")
    if version != OBJECT_VERSION:
        raise FormatError(f"object envelope version {version} is not supported (expected 1)")
    if params_len > MAX_PARAMS or HEADER_SIZE + params_len > len(data):
        raise FormatError("object header parameters out of bounds")
    if decoded_size > max_decoded_size:
        raise FormatError(
            f"object declares {decoded_size} bytes, above the limit {max_decoded_size}"
        )
    params = bytes(data[HEADER_SIZE : HEADER_SIZE + params_len])
    return Envelope(codec_id, decoded_size, params, HEADER_SIZE + params_len)


def encode_header(codec: Codec, params: bytes, decoded_size: int) -> bytes:
    """The header bytes that precede a payload."""
    return (
        HEADER.pack(OBJECT_MAGIC, OBJECT_VERSION, codec.codec_id, len(params), decoded_size)
        + params
    )


def decode_level(
    envelope: Envelope,
    blob: bytes | bytearray,
    below: tuple[Digest, bytes | memoryview] | None,
) -> bytes | memoryview:
    """Decode one object of a chain; ``below`` is its base, already decoded (None at the root)."""

    def base(digest: Digest) -> bytes | memoryview:
        # The headers walked before named this base; a blob rewritten since names another.
        if below is None or below[0] != digest:
            raise FormatError(f"delta base {digest} is not the one its chain named")
        return below[1]

    codec = codec_by_id(envelope.codec_id)
    return codec.decode(
        envelope.params, memoryview(blob)[envelope.payload_offset :], envelope.decoded_size, base
    )
