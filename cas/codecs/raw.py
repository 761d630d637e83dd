"""The raw codec (id 0): stored bytes are the decoded bytes, so local chunks can be mmapped."""

from __future__ import annotations

from cas.codecs.base import BaseFetcher, Codec, EncodeHints
from cas.errors import FormatError


class RawCodec(Codec):
    """Identity encoding."""

    codec_id = 0
    name = "raw"

    def encode(self, data: memoryview, hints: EncodeHints) -> tuple[bytes, bytes | memoryview]:
        return b"", data

    def decode(
        self, params: bytes, payload: memoryview, decoded_size: int, fetch_base: BaseFetcher
    ) -> bytes | memoryview:
        if len(payload) != decoded_size:
            raise FormatError(f"raw chunk holds {len(payload)} bytes, header says {decoded_size}")
        return payload
