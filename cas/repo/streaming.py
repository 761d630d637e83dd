"""Writing a stream of bytes as chunks while it arrives: what a file written through ``cas://`` is.

``StreamWriter`` feeds the bytes to a ``StreamCutter`` (``cas.objects.streamcut``: tensor
boundaries for known formats, content-defined cuts elsewhere) and stores each cut on the
repository's thread pool while the writer goes on, at most ``max_pending`` chunks in flight, so a
file is never held whole in memory. ``finish`` waits for every chunk and describes the file as a
manifest's file entry, with the tensors its regions name.
"""

from __future__ import annotations

from concurrent.futures import Future

from cas.codecs import Codec, EncodeHints
from cas.model.manifest import ChunkRef, FileEntry, FileRegion, TensorEntry
from cas.objects.chunking import Cut
from cas.objects.chunkio import ChunkIO, WriteStats, wait_all
from cas.objects.streamcut import StreamCutter, StreamRegion
from cas.repo.config import StoreConfig


class StreamWriter:
    """Cuts a stream into chunks and stores each on the chunk I/O pool as it is cut."""

    def __init__(
        self,
        io: ChunkIO,
        codec: Codec,
        config: StoreConfig,
        stats: WriteStats,
        max_pending: int = 8,
    ) -> None:
        self.io = io
        self.codec = codec
        self.level = config.compression_level
        self.stats = stats
        self.max_pending = max_pending
        self.cutter = StreamCutter(
            self._emit, config.chunk_size, config.cdc_avg_size, config.inline_max
        )
        self.pending: list[tuple[Future[ChunkRef], StreamRegion | None]] = []
        self._waited = 0

    def write(self, data: memoryview) -> None:
        """Take more bytes of the stream."""
        if len(data):
            self.cutter.write(data)

    def _emit(self, cut: Cut, data: bytes, region: StreamRegion | None) -> None:
        hints = EncodeHints(elem_size=region.elem_size if region else 1, level=self.level)
        (future,) = self.io.write_cuts(
            memoryview(data), [Cut(0, cut.size)], self.codec, hints, self.stats
        )
        self.pending.append((future, region))
        while len(self.pending) - self._waited > self.max_pending:
            self.pending[self._waited][0].result()  # bound the bytes held in flight
            self._waited += 1

    def finish(self) -> tuple[FileEntry, tuple[TensorEntry, ...]]:
        """End the stream, wait for every chunk, and describe the file: its entry, and the
        tensors its regions name (their indices count from 0 in that tuple)."""
        self.cutter.finish()
        wait_all(f for f, _ in self.pending)
        chunks = tuple(f.result() for f, _ in self.pending)
        regions: list[FileRegion] = []
        tensors: list[TensorEntry] = []
        complete = {id(t) for t in self.cutter.complete_tensors()}
        for region in self.cutter.regions:
            if region.tensor is None or id(region.tensor) not in complete:
                continue
            own = tuple(c for c, (_, r) in zip(chunks, self.pending, strict=True) if r is region)
            t = region.tensor
            regions.append(FileRegion(t.name, len(tensors), t.offset))
            tensors.append(TensorEntry("torch", t.dtype, tuple(t.shape), t.nbytes, own))
        for t, data in self.cutter.complete_small_tensors():  # in the gap's chunks; inline too
            regions.append(FileRegion(t.name, len(tensors), t.offset))
            tensors.append(TensorEntry("torch", t.dtype, tuple(t.shape), t.nbytes, (), data))
        regions.sort(key=lambda r: (r.offset, r.tensor_index))
        tensors = [tensors[r.tensor_index] for r in regions]  # region i names tensors[i]
        regions = [FileRegion(r.name, i, r.offset) for i, r in enumerate(regions)]
        entry = FileEntry(self.cutter.size, self.cutter.format, chunks, tuple(regions), 0o644)
        return entry, tuple(tensors)
