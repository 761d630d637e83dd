"""Stored versus logical bytes: what a checkpoint, or any set of chunks, occupies in a store.

Logical bytes are what a reader gets back; stored bytes are the sizes of the chunk objects as
the store reports them (headers included), each unique chunk counted once. A delta-encoded
checkpoint needs its bases too: ``Usage.stored_with_bases`` counts them, ``stored_bytes`` only
the chunks the checkpoint names itself (what keeping it costs on top of its bases).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cas.digest import Digest
from cas.errors import NotFound
from cas.model.manifest import Manifest

if TYPE_CHECKING:
    from cas.repo.repository import Repository


@dataclass(frozen=True)
class Usage:
    """Sizes of one manifest's data."""

    logical_bytes: int
    stored_bytes: int
    stored_with_bases: int
    chunks: int
    base_chunks: int
    missing_chunks: int

    @property
    def ratio(self) -> float:
        """``stored_bytes / logical_bytes`` (0 for an empty checkpoint)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Plain numbers for ``--json``."""
        return {
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "stored_with_bases": self.stored_with_bases,
            "ratio": round(self.ratio, 4),
            "chunks": self.chunks,
            "base_chunks": self.base_chunks,
            "missing_chunks": self.missing_chunks,
        }


def chunk_sizes(repo: Repository, digests: Iterable[Digest]) -> dict[Digest, int | None]:
    """Stored size of each unique chunk (``None`` when it is missing), statted in parallel."""
    unique = sorted(set(digests))

    def size_of(digest: Digest) -> int | None:
        try:
            return repo.objects.stored_size(digest)
        except NotFound:
            return None

    return dict(zip(unique, repo.io.pool.map(size_of, unique), strict=True))


def stored_bytes(repo: Repository, digests: Iterable[Digest]) -> int:
    """Bytes the unique chunks among ``digests`` occupy in ``repo`` (missing ones count 0)."""
    return sum(size or 0 for size in chunk_sizes(repo, digests).values())


def manifest_usage(repo: Repository, manifest: Manifest) -> Usage:
    """Logical and stored bytes of one manifest (reads chunk sizes, never chunk data)."""
    own = {ref.digest for ref in manifest.chunk_refs()}
    bases = manifest.chunk_digests() - own
    sizes = chunk_sizes(repo, own | bases)
    own_bytes = sum(sizes[d] or 0 for d in own)
    return Usage(
        logical_bytes=manifest.logical_bytes(),
        stored_bytes=own_bytes,
        stored_with_bases=own_bytes + sum(sizes[d] or 0 for d in bases),
        chunks=len(own),
        base_chunks=len(bases),
        missing_chunks=sum(1 for size in sizes.values() if size is None),
    )
