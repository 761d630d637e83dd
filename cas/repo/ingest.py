"""Ingesting files and directories byte-for-byte: ``Repository.put_path``'s work.

Known formats (safetensors, torch zip, HF checkpoint directories) are cut at tensor boundaries, so
their tensors dedup and delta-encode like saved ones; the gaps between tensors and opaque files
are cut by content (FastCDC). Export writes back the very bytes that were ingested.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from cas.blobstore.base import file_kind
from cas.codecs import Codec, EncodeHints
from cas.digest import Digest
from cas.errors import FormatError, InvalidName, NotFound
from cas.formats import inspect_file
from cas.formats.hfdir import inspect_directory
from cas.model.manifest import (
    ITEMSIZE,
    ChunkRef,
    FileEntry,
    FileRegion,
    Manifest,
    TensorEntry,
    check_message,
    check_meta,
    check_tags,
)
from cas.names import check_relative_path, parse_ref_name
from cas.objects.chunking import Cut, file_cuts, fixed_cuts, windowed_cdc_cuts
from cas.objects.chunkio import Progress, WriteStats, wait_all
from cas.objects.encoding import PendingTensor, TensorTarget, TensorWriter
from cas.repo.core import RepositoryCore
from cas.repo.inputs import InputChanged, InputFile

CDC_WINDOW_SPANS = 16
"""A gap is read this many average chunks at a time (at least a chunk's size)."""
GAP_CHUNKS_IN_FLIGHT = 32
"""Gap chunks read but not yet stored, at most: a few windows' worth."""


def ingest_path(
    repo: RepositoryCore,
    path: str | os.PathLike[str],
    ref: str,
    metadata: dict[str, Any] | None,
    *,
    allow_opaque_pickles: bool,
    expected: Digest | Any | None,
    codec: str | None,
    parent: str | None,
    progress: Progress | None,
    overwrite: bool = False,
    message: str = "",
    tags: tuple[str, ...] = (),
) -> Digest:
    """Store a file or directory under ``ref``; see ``Repository.put_path``."""
    name = parse_ref_name(ref)
    tags = check_tags(tags)
    check_message(message)
    if expected is ...:  # a compare-and-swap is refused at the commit, by the ref's state
        repo.check_replaceable(name, overwrite=overwrite)
    source = Path(path)
    before: os.stat_result | None = None
    if source.is_dir():
        layouts = inspect_directory(source, allow_opaque_pickles=allow_opaque_pickles)
        files = [(rel, source / rel, layout) for rel, layout in layouts]
        kind = "dir"
    elif source.is_file():
        before = os.stat(source)  # a change while its format is read is a change too
        layout = inspect_file(source, allow_opaque_pickles=allow_opaque_pickles)
        files = [(source.name, source, layout)]
        kind = "file"
    else:
        try:
            mode = os.stat(source).st_mode
        except FileNotFoundError:
            raise NotFound(f"no such file or directory: {source}") from None
        except OSError as e:
            raise NotFound(f"cannot read {source}: {e.strerror}") from e
        raise FormatError(
            f"{source}: {file_kind(mode)}, not a regular file or directory (cas stores only those)"
        )
    for rel, _, _ in files:  # refuse before any chunk is written
        try:
            check_relative_path(rel)
        except InvalidName:
            raise FormatError(
                f"{source}: cannot store a file named {rel!r} (control characters and "
                "backslashes are refused in stored paths)"
            ) from None
    stats = WriteStats()
    tensors: list[TensorEntry] = []
    entries: dict[str, FileEntry] = {}
    parent_digest = repo._parent_digest(name, parent)
    writer, parents = repo._tensor_writer(codec, stats, progress, parent_digest)
    for rel, file_path, layout in files:
        entries[rel] = _write_file(
            repo,
            file_path,
            layout,
            repo.codec(codec),
            tensors,
            stats,
            progress,
            (writer, parents, rel),
            before,
        )
    writer.refresh_bases(tensors)
    meta = {**check_meta(metadata), "source": kind, "name": source.name}  # ours win
    manifest = Manifest(
        kind="files",
        tensors=tuple(tensors),
        files=entries,
        meta=meta,
        created_at=repo.clock(),
        parent=parent_digest,
        chunk_size=repo.config.chunk_size,
        message=message,
        tags=tags,
    )
    return repo.commit(
        manifest,
        name,
        expected=expected,
        op="put",
        message=message or str(source),
        stats=stats,
        overwrite=overwrite,
    )


def _write_file(
    repo: RepositoryCore,
    path: Path,
    layout: Any,
    codec: Codec,
    tensors: list[TensorEntry],
    stats: WriteStats,
    progress: Progress | None,
    delta: tuple[TensorWriter, dict[str, TensorEntry], str],
    before: os.stat_result | None = None,
) -> FileEntry:
    """Store one file's chunks and describe it; InputChanged if it changed while it was read.

    Region chunks are read on the pool, each into a buffer of its own; the gaps between regions
    are read here, a window at a time, and cut by content (``cas.repo.inputs``). A tensor of
    at most ``inline_max`` bytes stays in the gap's chunks and is described inline as well, as a
    saved one would be, so that every tensor of the file is listed and compared.
    """
    writer, parents, rel = delta
    config = repo.config
    regions = [r for r in layout.regions if r.nbytes > config.inline_max]
    small = [r for r in layout.regions if r.nbytes <= config.inline_max]
    with InputFile(path, before) as source:
        if source.size != layout.size:
            raise InputChanged(path, "its size differs from when its format was read")
        if source.size == 0:
            return FileEntry(0, layout.format, (), (), source.mode, source.mtime_ns)
        gaps = _GapWriter(repo, source, codec, stats, repo.leases.beat(progress))
        submitted: list[PendingTensor] = []
        cut_list: list[tuple[Cut, int | None]] = []
        try:
            spans = [(r.offset, r.nbytes) for r in regions]
            for cut, index in file_cuts(source.size, spans, config.chunk_size, gaps.cut):
                cut_list.append((cut, index))
                if index is not None and index == len(submitted):
                    region = regions[index]
                    target = TensorTarget(
                        source,
                        fixed_cuts(region.nbytes, config.chunk_size, start=region.offset),
                        region.dtype,
                        ITEMSIZE.get(region.dtype, 1),
                        parents.get(f"{rel}:{region.name}") or parents.get(region.name),
                    )
                    submitted.append(writer.submit(target))
        finally:
            # Every read ends before the file is closed, whatever failed.
            wait_all([*gaps.futures, *(f for p in submitted for f in p.futures())])
        small_bytes = [source.read(r.offset, r.nbytes) for r in small]
        source.check_unchanged()
    file_regions = []
    for region, written in zip(regions, submitted, strict=True):
        file_regions.append(FileRegion(region.name, len(tensors), region.offset))
        tensors.append(writer.entry("torch", written, tuple(region.shape)))
    gap_refs = iter([f.result() for f in gaps.futures])
    regions_chunks = [iter(tensors[r.tensor_index].chunks) for r in file_regions]
    chunks = [next(gap_refs) if i is None else next(regions_chunks[i]) for _, i in cut_list]
    for region, data in zip(small, small_bytes, strict=True):
        file_regions.append(FileRegion(region.name, len(tensors), region.offset))
        tensors.append(TensorEntry("torch", region.dtype, tuple(region.shape), len(data), (), data))
    file_regions.sort(key=lambda r: (r.offset, r.tensor_index))
    return FileEntry(
        source.size,
        layout.format,
        tuple(chunks),
        tuple(file_regions),
        source.mode,
        source.mtime_ns,
    )


class _GapWriter:
    """Reads the gaps of a file a window at a time, cuts them by content and stores the cuts.

    Chunks in flight hold their window's bytes, so beyond ``GAP_CHUNKS_IN_FLIGHT`` of them the
    reader waits for the oldest: memory stays bounded whatever the file's size.
    """

    def __init__(
        self,
        repo: RepositoryCore,
        source: InputFile,
        codec: Codec,
        stats: WriteStats,
        progress: Progress | None,
    ) -> None:
        self.repo = repo
        self.source = source
        self.codec = codec
        self.hints = EncodeHints(elem_size=1, level=repo.config.compression_level)
        self.stats = stats
        self.progress = progress
        self.futures: list[Future[ChunkRef]] = []
        self._settled = 0

    def cut(self, start: int, end: int) -> list[Cut]:
        """Cut and store the gap ``[start, end)``; its cuts."""
        avg = self.repo.config.cdc_avg_size
        window = max(avg * CDC_WINDOW_SPANS, self.repo.config.chunk_size)
        return windowed_cdc_cuts(self.source.read, start, end, avg, window, self._store)

    def _store(self, window: bytes, window_start: int, cuts: list[Cut]) -> None:
        local = [Cut(c.offset - window_start, c.size) for c in cuts]
        self.futures.extend(
            self.repo.io.write_cuts(
                memoryview(window), local, self.codec, self.hints, self.stats, self.progress
            )
        )
        while len(self.futures) - self._settled > GAP_CHUNKS_IN_FLIGHT:
            self.futures[self._settled].result()
            self._settled += 1
