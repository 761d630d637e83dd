"""Ingesting files and directories byte-for-byte: ``Repository.put_path``'s work.

Known formats (safetensors, torch zip, HF checkpoint directories) are cut at tensor boundaries, so
their tensors dedup and delta-encode like saved ones; the gaps between tensors and opaque files
are cut by content (FastCDC). Export writes back the very bytes that were ingested.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from cas.codecs import Codec, EncodeHints
from cas.digest import Digest
from cas.errors import FormatError, InvalidName, NotFound
from cas.formats import inspect_file
from cas.formats.hfdir import inspect_directory
from cas.model.manifest import ITEMSIZE, FileEntry, FileRegion, Manifest, TensorEntry, check_meta
from cas.names import check_relative_path, parse_ref_name
from cas.objects.chunking import Cut, layout_cuts
from cas.objects.chunkio import Progress, WriteStats, wait_all
from cas.objects.encoding import TensorTarget, TensorWriter
from cas.repo.core import RepositoryCore


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
) -> Digest:
    """Store a file or directory under ``ref``; see ``Repository.put_path``."""
    name = parse_ref_name(ref)
    source = Path(path)
    if source.is_dir():
        layouts = inspect_directory(source, allow_opaque_pickles=allow_opaque_pickles)
        files = [(rel, source / rel, layout) for rel, layout in layouts]
        kind = "dir"
    elif source.is_file():
        layout = inspect_file(source, allow_opaque_pickles=allow_opaque_pickles)
        files = [(source.name, source, layout)]
        kind = "file"
    else:
        raise NotFound(f"no such file or directory: {source}")
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
    )
    return repo.commit(
        manifest, name, expected=expected, op="put", message=str(source), stats=stats
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
) -> FileEntry:
    writer, parents, rel = delta
    regions = [r for r in layout.regions if r.nbytes > repo.config.inline_max]
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != layout.size:
            raise FormatError(f"{path} changed while it was being read")
        mode = os.fstat(f.fileno()).st_mode & 0o777
        if size == 0:
            return FileEntry(0, layout.format, (), (), mode)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                cut_list: list[tuple[Cut, int | None]] = list(
                    layout_cuts(
                        view,
                        [(r.offset, r.nbytes) for r in regions],
                        repo.config.chunk_size,
                        repo.config.cdc_avg_size,
                    )
                )
                gap_futures = repo.io.write_cuts(
                    view,
                    [c for c, i in cut_list if i is None],
                    codec,
                    EncodeHints(elem_size=1, level=repo.config.compression_level),
                    stats,
                    repo.leases.beat(progress),
                )
                submitted = []
                for index, region in enumerate(regions):
                    target = TensorTarget(
                        view,
                        [c for c, i in cut_list if i == index],
                        region.dtype,
                        ITEMSIZE.get(region.dtype, 1),
                        parents.get(f"{rel}:{region.name}") or parents.get(region.name),
                    )
                    submitted.append(writer.submit(target))
                wait_all([*gap_futures, *(f for p in submitted for f in p.futures())])
            finally:
                view.release()
    file_regions = []
    for region, written in zip(regions, submitted, strict=True):
        file_regions.append(FileRegion(region.name, len(tensors), region.offset))
        tensors.append(writer.entry("torch", written, tuple(region.shape)))
    gaps = iter([f.result() for f in gap_futures])
    regions_chunks = [iter(tensors[r.tensor_index].chunks) for r in file_regions]
    chunks = [next(gaps) if i is None else next(regions_chunks[i]) for _, i in cut_list]
    return FileEntry(size, layout.format, tuple(chunks), tuple(file_regions), mode)
