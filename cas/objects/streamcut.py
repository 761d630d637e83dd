"""Streaming cuts: cut a byte stream as it arrives exactly as ``layout_cuts`` cuts the whole file.

Tensor regions are recognised while the stream passes: a safetensors header names them up front,
and the local headers and data descriptors of zip members (``torch.save`` files, and DCP
``.distcp`` files, which are torch zips laid end to end) mark ``<archive>/data/<key>`` storages
as they go by. Regions larger than ``inline_max`` are cut at fixed sizes aligned to their first
byte and the bytes between them by FastCDC, as ``Repository.put_path`` does, so a file written
through ``cas://`` shares chunks with the same file ingested from disk and with the same tensors
saved by ``Repository.save``. Recognising regions only steers where cuts fall: whatever the
finder concludes, the cuts laid end to end are exactly the stream's bytes.

Only bytes not yet cut are buffered: at most a chunk of a region, or a few CDC spans of a gap
(plus a zip member whose end is not known yet while it is small).
"""

from __future__ import annotations

import io
import re
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cas.errors import FormatError
from cas.formats.layout import TensorRegion
from cas.objects.chunking import Cut, cdc_cuts

_UNBOUNDED = 1 << 62
_CDC_BATCH_SPANS = 8
"""Gap bytes are cut once this many average chunks are buffered (all but the last cut is final)."""

_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_CENTRAL = b"PK\x01\x02"
_ZIP_END = b"PK\x05\x06"
_ZIP64_END = b"PK\x06\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP_DESCRIPTOR = b"PK\x07\x08"
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_STORAGE_NAME = re.compile(rb"[^/]+/data/[^/]+")
_SAFETENSORS_HEADER_CAP = 100 * 1024 * 1024


@dataclass
class StreamRegion:
    """A run of tensor bytes in the stream; ``end`` is None while a zip member is still open."""

    start: int
    end: int | None
    elem_size: int = 1
    tensor: TensorRegion | None = None
    """The named tensor (safetensors) this region holds, recorded in the manifest."""


class _Finder:
    """Announces regions in stream order. Every region starting below ``frontier`` is announced;
    bytes from ``keep_from`` on may still be read by the finder, so they stay buffered."""

    format = "opaque"

    def __init__(self) -> None:
        self.regions: deque[StreamRegion] = deque()
        self.frontier = 0
        self.keep_from = 0

    def scan(self, buf: bytearray, buf_start: int, end: int, final: bool) -> _Finder:
        """Look at the bytes ``[buf_start, end)``; return the finder to use from now on."""
        raise FormatError("a region finder must implement scan")


class _NoRegions(_Finder):
    def __init__(self) -> None:
        super().__init__()
        self.frontier = self.keep_from = _UNBOUNDED

    def scan(self, buf: bytearray, buf_start: int, end: int, final: bool) -> _Finder:
        return self


class _Sniffer(_Finder):
    """Waits for the first bytes, then hands over to the finder for the format they show."""

    def scan(self, buf: bytearray, buf_start: int, end: int, final: bool) -> _Finder:
        head = bytes(buf[: min(16, end - buf_start)])
        if head.startswith(_ZIP_LOCAL):
            return _ZipFinder().scan(buf, buf_start, end, final)
        if len(head) < 9:
            return _NoRegions() if final else self
        header_len = int.from_bytes(head[:8], "little")
        if head[8:9] != b"{" or not 2 <= header_len <= _SAFETENSORS_HEADER_CAP:
            return _NoRegions()
        if end < 8 + header_len:
            return _NoRegions() if final else self
        return _safetensors_finder(bytes(buf[: 8 + header_len]))


def _safetensors_finder(head: bytes) -> _Finder:
    from cas.formats._safetensors import inspect_safetensors

    try:
        layout = inspect_safetensors("stream", io.BytesIO(head), _UNBOUNDED)
    except FormatError:
        return _NoRegions()  # not valid safetensors after all: plain bytes
    finder = _NoRegions()
    finder.format = "safetensors"
    for region in layout.regions:
        itemsize = max(1, _itemsize(region.dtype))
        finder.regions.append(StreamRegion(region.offset, region.end, itemsize, region))
    return finder


def _itemsize(dtype: str) -> int:
    from cas.model.manifest import ITEMSIZE

    return ITEMSIZE.get(dtype, 1)


class _ZipFinder(_Finder):
    """Walks zip records; stored ``*/data/*`` members become regions.

    torch writes members with a trailing data descriptor (flag bit 3), so a member's length is
    known only when the descriptor ``PK\\x07\\x08`` whose size field equals the bytes since the
    member's start is seen. Anything unexpected ends the walk; the rest is plain bytes.
    """

    format = "torch-zip"

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.member_start: int | None = None
        self.member_region: StreamRegion | None = None
        self.scan_from = 0

    def scan(self, buf: bytearray, buf_start: int, end: int, final: bool) -> _Finder:
        while True:
            if self.member_start is not None:
                if not self._find_descriptor(buf, buf_start, end, final):
                    break
                continue
            step = self._record(buf, buf_start, end)
            if step is None:
                if final:
                    return self._give_up()
                break
            if step < 0:
                return self._give_up()
        if final and self.member_region is not None and self.member_region.end is None:
            self.member_region.end = end  # never closed: the region runs to the end
        self.frontier = self.scan_from if self.member_start is not None else self.pos
        self.keep_from = min(self.frontier, self.pos)
        return self

    def _give_up(self) -> _Finder:
        rest = _NoRegions()
        rest.format = self.format
        rest.regions = self.regions
        return rest

    def _record(self, buf: bytearray, buf_start: int, end: int) -> int | None:
        """Parse one record at ``pos``: None if more bytes are needed, -1 if it is not a record."""
        at = self.pos - buf_start
        if end - self.pos < 4:
            return None
        sig = bytes(buf[at : at + 4])
        if sig == _ZIP_LOCAL:
            if end - self.pos < _LOCAL_HEADER.size:
                return None
            (_, _, flags, method, _, _, _, csize, _, name_len, extra_len) = (
                _LOCAL_HEADER.unpack_from(buf, at)
            )
            data_start = self.pos + _LOCAL_HEADER.size + name_len + extra_len
            if end < data_start:
                return None
            name = bytes(buf[at + _LOCAL_HEADER.size : at + _LOCAL_HEADER.size + name_len])
            storage = method == 0 and _STORAGE_NAME.fullmatch(name) is not None
            if flags & 0x08:
                self.member_start = self.scan_from = data_start
                self.member_region = StreamRegion(data_start, None) if storage else None
                if self.member_region is not None:
                    self.regions.append(self.member_region)
                self.pos = data_start
                return 1
            if csize == 0xFFFFFFFF:
                return -1  # zip64 sizes in the extra field: not worth parsing for a hint
            if storage and csize:
                self.regions.append(StreamRegion(data_start, data_start + csize))
            self.pos = data_start + csize
            return 1
        sizes = {_ZIP_CENTRAL: 46, _ZIP_END: 22, _ZIP64_END: 12, _ZIP64_LOCATOR: 20}
        fixed = sizes.get(sig)
        if fixed is None:
            return -1
        if end - self.pos < fixed:
            return None
        if sig == _ZIP_CENTRAL:
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", buf, at + 28)
            self.pos += fixed + name_len + extra_len + comment_len
        elif sig == _ZIP_END:
            self.pos += fixed + struct.unpack_from("<H", buf, at + 20)[0]
        elif sig == _ZIP64_END:
            self.pos += fixed + struct.unpack_from("<Q", buf, at + 4)[0]
        else:
            self.pos += fixed
        return 1

    def _find_descriptor(self, buf: bytearray, buf_start: int, end: int, final: bool) -> bool:
        """Advance to the member's descriptor; False if it is not in the buffer yet."""
        assert self.member_start is not None
        while True:
            found = buf.find(_ZIP_DESCRIPTOR, self.scan_from - buf_start, end - buf_start)
            if found < 0:
                self.scan_from = max(self.scan_from, end - 3)
                return False
            at = buf_start + found
            length = at - self.member_start
            if end - at < 24 and not final:
                self.scan_from = at
                return False
            small = end - at >= 16 and struct.unpack_from("<I", buf, found + 8)[0] == length
            large = end - at >= 24 and struct.unpack_from("<Q", buf, found + 8)[0] == length
            if small or large:
                if self.member_region is not None:
                    self.member_region.end = at
                self.member_start = self.member_region = None
                self.pos = self.scan_from = at + (16 if small else 24)
                return True
            self.scan_from = at + 1


Emit = Callable[[Cut, bytes, StreamRegion | None], None]
"""Receives each cut in stream order, with a copy of its bytes and the region it lies in."""


class StreamCutter:
    """Feed bytes with ``write``; each final cut goes to ``emit`` as soon as it is known."""

    def __init__(self, emit: Emit, chunk_size: int, cdc_avg: int, inline_max: int) -> None:
        self._emit = emit
        self._chunk_size = chunk_size
        self._cdc_avg = cdc_avg
        self._inline_max = inline_max
        self._finder: _Finder = _Sniffer()
        self._buf = bytearray()
        self._buf_start = 0
        self._pos = 0
        self.size = 0
        self.regions: list[StreamRegion] = []
        """Regions that were cut as regions, in stream order (for the manifest)."""
        self.small: list[tuple[TensorRegion, bytearray]] = []
        """Named tensors of at most ``inline_max`` bytes, left in the gap, with their bytes as
        they went by (for the manifest, inline)."""
        self._open_small: list[tuple[TensorRegion, bytearray]] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes to the stream."""
        self._buf += data
        self.size += len(memoryview(data).cast("B"))
        self._advance(final=False)

    def finish(self) -> None:
        """The stream has ended: cut what is left."""
        self._advance(final=True)

    @property
    def format(self) -> str:
        """``safetensors`` or ``torch-zip`` when the stream was recognised, else ``opaque``."""
        return self._finder.format

    def complete_tensors(self) -> list[TensorRegion]:
        """Named tensors that were cut as whole regions (none if the file was truncated)."""
        return [r.tensor for r in self.regions if r.tensor is not None and r.end == r.tensor.end]

    def complete_small_tensors(self) -> list[tuple[TensorRegion, bytes]]:
        """Small named tensors whose bytes all went by, with those bytes."""
        return [(t, bytes(data)) for t, data in self.small if len(data) == t.nbytes]

    def _view(self, start: int, end: int) -> bytes:
        return bytes(self._buf[start - self._buf_start : end - self._buf_start])

    def _cut(self, start: int, end: int, region: StreamRegion | None) -> None:
        self._emit(Cut(start, end - start), self._view(start, end), region)
        if region is None and self._open_small:
            self._copy_small(start, end)
        self._pos = end

    def _copy_small(self, start: int, end: int) -> None:
        """Keep the bytes of small named tensors that lie in the gap cut ``[start, end)``."""
        still_open = []
        for tensor, data in self._open_small:
            lo, hi = max(start, tensor.offset + len(data)), min(end, tensor.end)
            if lo < hi:
                data += self._view(lo, hi)
            if len(data) < tensor.nbytes:
                still_open.append((tensor, data))
        self._open_small = still_open

    def _cut_gap(self, limit: int, complete: bool) -> None:
        cuts = cdc_cuts(
            memoryview(self._buf)[self._pos - self._buf_start : limit - self._buf_start],
            self._cdc_avg,
            start=self._pos,
        )
        for cut in cuts if complete else cuts[:-1]:
            self._cut(cut.offset, cut.offset + cut.size, None)

    def _advance(self, final: bool) -> None:
        self._finder = self._finder.scan(self._buf, self._buf_start, self.size, final)
        regions = self._finder.regions
        while True:
            region = regions[0] if regions else None
            if final and region is not None and region.end is not None and region.end > self.size:
                region.end = max(region.start, self.size)  # a truncated file
            if (
                region is not None
                and region.end is not None
                and (region.end - region.start <= self._inline_max)
            ):
                regions.popleft()  # small regions stay in the gap, as put_path leaves them
                if region.tensor is not None and region.end == region.tensor.end:
                    kept = (region.tensor, bytearray())
                    self.small.append(kept)
                    if region.tensor.nbytes:
                        self._open_small.append(kept)
                continue
            if region is not None and region.start <= self._pos:
                if not self._cut_region(region, final):
                    break
                regions.popleft()
                self.regions.append(region)
                continue
            gap_end = region.start if region is not None else None
            if region is not None and self._is_big(region) and self.size >= region.start:
                self._cut_gap(region.start, complete=True)
                continue
            if gap_end is None and final:
                self._cut_gap(self.size, complete=True)
                break
            limit = min(self.size, gap_end if gap_end is not None else self._finder.frontier)
            if limit - self._pos >= _CDC_BATCH_SPANS * self._cdc_avg:
                self._cut_gap(limit, complete=False)
            break
        self._trim()

    def _certain_end(self, region: StreamRegion) -> int:
        """How far the region's bytes are known: its end, or where its end could first be."""
        if region.end is not None:
            return min(region.end, self.size)
        return max(region.start, min(self.size, self._finder.frontier))

    def _is_big(self, region: StreamRegion) -> bool:
        return self._certain_end(region) - region.start > self._inline_max or (
            region.end is not None and region.end - region.start > self._inline_max
        )

    def _cut_region(self, region: StreamRegion, final: bool) -> bool:
        """Cut what is certain of a region; True once the region is fully cut."""
        if not self._is_big(region):
            return False  # an open zip member that may still turn out small
        limit = self._certain_end(region)
        while self._pos + self._chunk_size <= limit:
            self._cut(self._pos, self._pos + self._chunk_size, region)
        if region.end is not None and self.size >= region.end:
            if self._pos < region.end:
                self._cut(self._pos, region.end, region)
            return True
        return False

    def _trim(self) -> None:
        drop = min(self._pos, self._finder.keep_from) - self._buf_start
        if drop > 0 and (drop >= len(self._buf) // 2 or drop >= 16 << 20):
            del self._buf[:drop]
            self._buf_start += drop
