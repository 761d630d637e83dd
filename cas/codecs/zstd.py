"""The zstd codec (id 1): plain zstandard, decompressed into exactly the declared size."""

from __future__ import annotations

import threading

import zstandard

from cas.codecs.base import BaseFetcher, Codec, EncodeHints
from cas.errors import FormatError

_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor: a context costs more to set up than a small frame to decode."""
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def zstd_decompress_bounded(payload: memoryview | bytes, decoded_size: int) -> bytes:
    """Decompress a single zstd frame, refusing anything that is not exactly ``decoded_size``."""
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise FormatError(f"corrupt zstd payload: {e}") from e
    # zstandard trusts a frame's declared content size over max_output_size; check it first.
    if declared not in (-1, decoded_size):
        raise FormatError(f"zstd frame declares {declared} bytes, header says {decoded_size}")
    try:
        out = _decompressor().decompress(
            payload, max_output_size=decoded_size if decoded_size > 0 else 1
        )
    except zstandard.ZstdError as e:
        raise FormatError(f"corrupt zstd payload: {e}") from e
    if len(out) != decoded_size:
        raise FormatError(f"zstd payload decodes to {len(out)} bytes, header says {decoded_size}")
    return out


class ZstdCodec(Codec):
    """zstandard at the hinted level."""

    codec_id = 1
    name = "zstd"

    def encode(self, data: memoryview, hints: EncodeHints) -> tuple[bytes, bytes]:
        compressor = zstandard.ZstdCompressor(level=hints.level, write_content_size=True)
        return b"", compressor.compress(data)

    def decode(
        self, params: bytes, payload: memoryview, decoded_size: int, fetch_base: BaseFetcher
    ) -> bytes | memoryview:
        return zstd_decompress_bounded(payload, decoded_size)
