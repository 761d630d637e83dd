"""Where bytes are cut into chunks: fixed slices aligned to a tensor's start, FastCDC for the rest."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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

    def cut_gap(start: int, end: int) -> list[Cut]:
        return cdc_cuts(data[start:end], cdc_avg, start=start)

    return file_cuts(len(data), regions, chunk_size, cut_gap)


GapCutter = Callable[[int, int], Sequence[Cut]]
"""Cuts the gap ``[start, end)`` of a file by content, however it reads those bytes."""


def file_cuts(
    size: int, regions: Sequence[tuple[int, int]], chunk_size: int, cut_gap: GapCutter
) -> Iterator[tuple[Cut, int | None]]:
    """``layout_cuts`` of a file of ``size`` bytes whose gaps ``cut_gap`` cuts, in file order
    (it is called for each gap when its place comes)."""
    position = 0
    for index, (offset, nbytes) in enumerate(regions):
        if offset > position:
            for cut in cut_gap(position, offset):
                yield cut, None
        for cut in fixed_cuts(nbytes, chunk_size, start=offset):
            yield cut, index
        position = max(position, offset + nbytes)
    if position < size:
        for cut in cut_gap(position, size):
            yield cut, None


def windowed_cdc_cuts(
    read: Callable[[int, int], bytes],
    start: int,
    end: int,
    avg_size: int,
    window: int,
    emit: Callable[[bytes, int, list[Cut]], None],
) -> list[Cut]:
    """``cdc_cuts`` of the bytes ``[start, end)`` read ``window`` bytes at a time: the same cuts.

    A FastCDC cut depends only on the bytes from the previous cut on, so every cut of a window
    but the last is final; the last one's bytes are carried into the next window. ``emit``
    gets each window's bytes, the file offset of their first byte and its final cuts, while
    the bytes are at hand.
    """
    cuts: list[Cut] = []
    carried = b""
    at = start
    while at < end:
        fresh = read(at, min(window, end - at))
        data = carried + fresh if carried else fresh
        data_start = at - len(carried)
        at += len(fresh)
        found = cdc_cuts(data, avg_size, start=data_start)
        final = found if at >= end else found[:-1]
        if final:
            emit(data, data_start, final)
            cuts.extend(final)
        if at < end:
            last = found[-1]
            carried = data[last.offset - data_start :]
    return cuts
