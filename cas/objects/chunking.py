"""Where bytes are cut into chunks: fixed slices aligned to a tensor's start, FastCDC for the rest."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pyfastcdc.cy import FastCDC

DEFAULT_CHUNK_SIZE = 4 << 20
DEFAULT_CDC_AVG = 1 << 20


@dataclass(frozen=True)
class Cut:
    """One chunk's place in a buffer or file: ``[offset, offset + size)``."""

    offset: int
    size: int


def fixed_cuts(length: int, chunk_size: int, start: int = 0) -> list[Cut]:
    """Cut ``length`` bytes beginning at ``start`` into ``chunk_size`` slices, the last shorter.

    Aligning to the tensor's first byte (not the file's) is what lets an unchanged slice of a
    changed tensor, or the same tensor inside a safetensors file, produce the same chunks.
    """
    if length == 0:
        return []
    return [
        Cut(start + offset, min(chunk_size, length - offset))
        for offset in range(0, length, chunk_size)
    ]


def cdc_cuts(
    data: memoryview | bytes, avg_size: int = DEFAULT_CDC_AVG, start: int = 0
) -> list[Cut]:
    """Content-defined cuts (FastCDC) of an opaque byte run."""
    if len(data) == 0:
        return []
    # FastCDC requires min >= 64; small runs are simply one chunk.
    if len(data) <= avg_size // 4:
        return [Cut(start, len(data))]
    cutter = FastCDC(avg_size=avg_size)
    return [Cut(start + c.offset, c.length) for c in cutter.cut_buf(data)]


def layout_cuts(
    data: memoryview,
    regions: Sequence[tuple[int, int]],
    chunk_size: int,
    cdc_avg: int = DEFAULT_CDC_AVG,
) -> Iterator[tuple[Cut, int | None]]:
    """Cut a whole file: each ``(offset, nbytes)`` region fixed-size, the gaps by FastCDC.

    Yields ``(cut, region_index)``, region_index ``None`` for gap chunks, in file order.
    """
    position = 0
    for index, (offset, nbytes) in enumerate(regions):
        if offset > position:
            for cut in cdc_cuts(data[position:offset], cdc_avg, start=position):
                yield cut, None
        for cut in fixed_cuts(nbytes, chunk_size, start=offset):
            yield cut, index
        position = max(position, offset + nbytes)
    if position < len(data):
        for cut in cdc_cuts(data[position:], cdc_avg, start=position):
            yield cut, None
