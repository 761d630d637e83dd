"""Where objects live in a BlobStore: one key per chunk or manifest, sharded by digest prefix.

A chunk is stored under ``chunks/<d[:2]>/<d>``, a manifest under ``manifests/<d[:2]>/<d>``. Keys
that do not have this exact shape are not cas objects: listings skip them and GC never deletes
them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from cas.digest import Digest


class ObjectKind(Enum):
    """The two kinds of stored object; the value is the top-level key prefix."""

    CHUNK = "chunks"
    MANIFEST = "manifests"

    @property
    def prefix(self) -> str:
        """The key prefix every object of this kind is stored under (``chunks/``)."""
        return self.value + "/"

    @property
    def noun(self) -> str:
        """``chunk`` or ``manifest``, for messages."""
        return "chunk" if self is ObjectKind.CHUNK else "manifest"

    @property
    def pattern(self) -> re.Pattern[str]:
        """A key of this kind: group 2 is the digest."""
        return _PATTERNS[self]


_PATTERNS = {
    kind: re.compile(rf"{kind.value}/([0-9a-f]{{2}})/(\1[0-9a-f]{{62}})") for kind in ObjectKind
}


def object_key(kind: ObjectKind, digest: Digest) -> str:
    """The blob key of an object."""
    return f"{kind.value}/{digest[:2]}/{digest}"


def parse_object_key(key: str) -> tuple[ObjectKind, Digest] | None:
    """The kind and digest a key names, or None when it is not an object's key."""
    for kind in ObjectKind:
        match = kind.pattern.fullmatch(key)
        if match is not None:
            return kind, Digest(match.group(2))
    return None


@dataclass(frozen=True)
class StoredObject:
    """One object as a listing or ``stat`` reports it: stored (encoded) size and mtime."""

    kind: ObjectKind
    digest: Digest
    size: int
    mtime: float
