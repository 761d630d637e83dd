"""A file of a checkpoint as extents: runs of chunk bytes (read on demand) or literal bytes.

Every file ``cas://`` shows, ingested or synthesized, is a ``FileView``: its size and a list of
extents laid end to end. A chunk extent names a chunk by digest and is fetched, verified, only when
a read touches it; a literal extent holds its bytes (synthesized headers, inline tensors).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cas.digest import Digest
from cas.model.manifest import ChunkRef, FileEntry, TensorEntry


@dataclass(frozen=True)
class Extent:
    """A run of a file's bytes: one chunk (``digest``) or literal ``data``."""

    offset: int
    size: int
    digest: Digest | None = None
    data: bytes | None = None


@dataclass(frozen=True)
class FileRecord:
    """An ingested file as a manifest holds it: its entry and the tensors its regions name."""

    entry: FileEntry
    tensors: tuple[TensorEntry, ...] = ()


@dataclass(frozen=True)
class FileView:
    """One file of a checkpoint: its size and extents; ``record`` is set for ingested files."""

    size: int
    extents: tuple[Extent, ...]
    mode: int = 0o644
    record: FileRecord | None = None
    starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "starts", tuple(e.offset for e in self.extents))

    @property
    def synthesized(self) -> bool:
        """Whether the bytes are computed from a saved state rather than ingested."""
        return self.record is None

    def touched(self, start: int, end: int) -> Iterator[Extent]:
        """The extents overlapping ``[start, end)``."""
        index = max(0, bisect.bisect_right(self.starts, start) - 1)
        while index < len(self.extents) and self.extents[index].offset < end:
            extent = self.extents[index]
            if extent.offset + extent.size > start:
                yield extent
            index += 1


def chunk_extents(chunks: Iterable[ChunkRef], offset: int) -> list[Extent]:
    """One extent per chunk, laid end to end from ``offset``."""
    out = []
    for ref in chunks:
        out.append(Extent(offset, ref.size, digest=ref.digest))
        offset += ref.size
    return out


def literal_view(data: bytes, mode: int) -> FileView:
    """A file whose bytes are all given."""
    return FileView(len(data), (Extent(0, len(data), data=data),) if data else (), mode)
