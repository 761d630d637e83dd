"""Archive: push refs to a remote store, drop them locally, free the local chunks nobody needs.

``archive(local, remote, selectors)``:

1. ``Repository.push`` the selected refs (chunks, manifests, then the remote refs by
   compare-and-swap). A conflict on the remote stops here: nothing local is touched.
2. For each pushed ref whose remote copy now names the same manifest, delete the local ref by
   compare-and-swap (a ref that moved locally meanwhile is kept, and so are its chunks).
3. Free local objects with the GC machinery (``cas.retention.gc``): its mark phase computes what
   every remaining local ref (and recent ref history, and live writer leases) still needs, and
   the object store's sweeper deletes, re-checking each object's mtime last. Only chunks and manifests of the
   archived checkpoints are deleted; other garbage is left to ``cas gc``.

The grace period defaults to 0 here, unlike ``cas gc``: the user named these checkpoints, they
are safely on the remote, and writers in flight are protected by their leases. To read an archived
checkpoint, ``cas pull`` it back or open the remote with a local cache (``cas.open(url, cache=)``).

Archiving composes a transfer with retention, two layers of the same rank that do not import
each other, so it lives here, above both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cas.digest import Digest
from cas.errors import LockHeld, NotFound, RefConflict
from cas.model.manifest import decode_manifest
from cas.objects.recode import KEEP
from cas.refs.stores import Stores
from cas.retention.gc import GCSettings, plan_gc
from cas.sync.transfer import TransferProgress, TransferReport, push


@dataclass
class ArchiveReport:
    """What was pushed, which local refs went away, and what was freed locally."""

    transfer: TransferReport
    removed_refs: list[str] = field(default_factory=list)
    kept_refs: list[str] = field(default_factory=list)
    """Pushed refs left in place because they moved locally (or remotely) meanwhile."""
    freed_chunks: int = 0
    freed_bytes: int = 0
    freed_manifests: int = 0
    kept_chunks: int = 0
    """Chunks of the archived checkpoints left in place: still used locally or recently touched."""
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        """Plain values for ``--json``."""
        return {
            "transfer": self.transfer.as_dict(),
            "removed_refs": self.removed_refs,
            "kept_refs": self.kept_refs,
            "freed_chunks": self.freed_chunks,
            "freed_bytes": self.freed_bytes,
            "freed_manifests": self.freed_manifests,
            "kept_chunks": self.kept_chunks,
            "note": self.note,
        }


def archive(
    local: Stores,
    remote: Stores,
    selectors: Sequence[str],
    *,
    settings: GCSettings,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    grace: float = 0.0,
    codec: str = KEEP,
) -> ArchiveReport:
    """Push ``selectors`` to ``remote``, remove them locally and free what no local ref needs.

    ``settings`` are the local store's GC settings; ``grace`` replaces their grace period.
    """
    pushed = push(local, remote, selectors, jobs=jobs, progress=progress, codec=codec)
    report = ArchiveReport(pushed)
    archived: set[Digest] = set()
    for update in pushed.refs:
        there = remote.refs.try_get(update.name)
        if there is None or there.target != update.new:
            report.kept_refs.append(update.name)
            continue
        try:
            local.refs.delete(update.name, expected=update.new)
        except (RefConflict, NotFound):
            report.kept_refs.append(update.name)
            continue
        report.removed_refs.append(update.name)
        archived.add(update.new)
    if not archived:
        return report

    candidates: set[str] = set()
    for digest in archived:
        candidates |= decode_manifest(local.objects.get_manifest(digest)).chunk_digests()
    try:
        plan = plan_gc(local, replace(settings, grace=grace))
        chunks = tuple(d for d in plan.chunks if d in candidates)
        manifests = tuple(d for d in plan.manifests if d in archived)
        # Only the archived objects: other garbage, temp files and leases are ``cas gc``'s job.
        narrowed = replace(
            plan, chunks=chunks, manifests=manifests, tmp_files=(), expired_leases=()
        )
        result = narrowed.execute()
    except LockHeld as e:
        report.note = f"local chunks not freed ({e}); run `cas gc` later"
        return report
    report.freed_chunks = result.deleted_chunks
    report.freed_bytes = result.deleted_chunk_bytes + result.deleted_manifest_bytes
    report.freed_manifests = result.deleted_manifests
    report.kept_chunks = len(candidates) - len(chunks)
    return report
