"""Repair: restore every object a full verification finds missing or corrupt from another store.

``repair(stores, source, selectors)`` verifies the selected refs in full (which quarantines what
is corrupt here), then for each missing or corrupt chunk and manifest copies a good one from
``source`` (the S3 archive, a peer's store): ``ObjectStore.copy`` verifies it there before it
travels. A chunk the source holds as a delta, or one still present here (a delta whose base was
bad, so it was not quarantined), is written standalone instead, under the same identity: its
base may be unknown to this store's manifests, and GC reads manifests only. A healed manifest
names chunks no one has checked yet, so the refs that were broken are verified again, and what
that finds is repaired in turn, a few rounds at most. What stays broken is reported by ref.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cas.codecs import codec_by_name
from cas.digest import Digest, parse_digest
from cas.errors import CASError
from cas.objects.chunkio import Progress
from cas.objects.keys import ObjectKind
from cas.objects.store import ObjectStore
from cas.refs.stores import Stores
from cas.retention.verify import VerifyReport, verify

HEALABLE = {
    "missing-chunk": ObjectKind.CHUNK,
    "corrupt-chunk": ObjectKind.CHUNK,
    "missing-manifest": ObjectKind.MANIFEST,
    "corrupt-manifest": ObjectKind.MANIFEST,
}
"""Problems another store's copy of one object can fix (a size mismatch is the manifest's)."""
MAX_ROUNDS = 4
"""Verify-and-heal rounds: a healed manifest reveals its chunks, which may need healing too."""


@dataclass(frozen=True)
class HealedObject:
    """One object restored from the source."""

    kind: str
    digest: str
    how: str
    """``copied`` (as the source stores it) or ``rewritten`` (standalone, from verified bytes)."""
    refs: tuple[str, ...]


@dataclass(frozen=True)
class UnhealedObject:
    """One object the source could not supply."""

    kind: str
    digest: str
    reason: str
    refs: tuple[str, ...]


@dataclass
class RepairReport:
    """What a repair found, restored, and what stays broken."""

    source: str
    before: VerifyReport
    after: VerifyReport
    """The last verification, of the refs that were broken only."""
    healed: list[HealedObject] = field(default_factory=list)
    unhealed: list[UnhealedObject] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every selected ref verifies now."""
        return self.after.ok

    def broken_refs(self) -> list[str]:
        """The refs still broken after the repair, sorted."""
        return self.after.broken_refs()


def repair(
    stores: Stores,
    source: ObjectStore,
    selectors: Iterable[str] = ("",),
    *,
    progress: Progress | None = None,
) -> RepairReport:
    """Verify the selected refs in full and restore what is missing or corrupt from ``source``."""
    before = verify(stores, selectors, level="full", progress=progress)
    report = RepairReport(source.url, before, before)
    tried: set[tuple[ObjectKind, Digest]] = set()
    current = before
    for _ in range(MAX_ROUNDS):
        todo = {}
        for problem in current.problems:
            kind = HEALABLE.get(problem.kind)
            if kind is not None and problem.digest and (kind, problem.digest) not in tried:
                todo[(kind, parse_digest(problem.digest))] = problem.refs or (problem.ref,)
        if not todo:
            break
        for (kind, digest), refs in sorted(todo.items(), key=lambda item: item[0][1]):
            tried.add((kind, digest))
            try:
                how = heal(stores.objects, source, kind, digest)
            except CASError as e:
                report.unhealed.append(UnhealedObject(kind.noun, digest, str(e), refs))
            else:
                report.healed.append(HealedObject(kind.noun, digest, how, refs))
        current = verify(stores, current.broken_refs(), level="full")
    report.after = current
    return report


def heal(store: ObjectStore, source: ObjectStore, kind: ObjectKind, digest: Digest) -> str:
    """Restore one object of ``store`` from ``source``; how (``copied`` or ``rewritten``).

    NotFound if the source lacks it, IntegrityError if the source's copy is bad too.
    """
    if kind is ObjectKind.MANIFEST:
        copied = source.copy(kind, digest, store)
        if not copied.created:
            store.get_manifest(digest)  # present here after all: raises unless it is good now
        return "copied"
    standalone_and_absent = source.chunk_base(digest) is None and not store.has_chunk(digest)
    if standalone_and_absent and source.copy(kind, digest, store).created:
        return "copied"
    data = source.get_chunk(digest)  # verified, whatever the source's encoding
    store.put_chunk(data, codec_by_name("zstd"), expected=digest, replace=True)
    return "rewritten"
