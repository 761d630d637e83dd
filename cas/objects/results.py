"""What the object layer's writes report: one chunk put, one object copied."""

from __future__ import annotations

from dataclasses import dataclass

from cas.digest import Digest
from cas.objects.keys import ObjectKind


@dataclass(frozen=True)
class PutResult:
    """What storing one chunk did: ``stored_bytes`` is 0 when the chunk already existed."""

    digest: Digest
    size: int
    stored_bytes: int
    new: bool
    base: Digest | None = None
    """The chunk the *stored* encoding is against (delta codecs), for a new chunk and an existing
    one alike: a writer that reuses a chunk must record its base chain in the manifest (GC reads
    manifests only). When a concurrent writer stored the chunk first, this is that writer's base,
    whatever this call encoded against, and ``new`` is False."""


@dataclass(frozen=True)
class CopiedObject:
    """What ``ObjectStore.copy`` did with one object."""

    kind: ObjectKind
    digest: Digest
    created: bool
    """False when the destination held the object already: its own encoding stayed."""
    size: int
    """Decoded bytes."""
    stored_bytes: int
    """Encoded bytes as stored here (what was written when ``created``)."""
    base: Digest | None
    """The delta base the copied encoding needs (it must travel too)."""
