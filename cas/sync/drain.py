"""The remote tier's drain: push a run's checkpoints to the remote and move its pointers after them.

A training run saves into a local store (the fast tier); a background drain (``cas.training.tiers``
runs it) copies each checkpoint to a remote store (the durable tier) with these steps, in the local
order, all under one writer lease on the remote (so a GC there spares what is copied, and a drain
whose lease ran out publishes nothing, invariant 11):

1. ``transfer`` the checkpoint ref: the chunks the remote lacks, the manifest, then the ref.
2. ``latest``: moved to the newest checkpoint of the local ``latest``'s history whose checkpoint
   ref already names the same manifest on the remote. So the remote's ``latest`` never names a
   checkpoint whose chunks are not all there (invariant 14), and after a crash between steps the
   next drain moves it where it should be.
3. ``best`` and gates (``pointers``): pushed once their target is no longer waiting in the queue
   (``hold_back``), so they follow their checkpoint rather than overtake it.

Nothing here keeps state: what is still to drain is the local checkpoint refs whose remote ref is
missing or names another manifest (``pending_checkpoints``), so a restarted run, or any process
holding both stores, finishes a drain its predecessor left.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

from cas.digest import Digest
from cas.errors import CASError, NotFound, RefConflict
from cas.model.manifest import decode_manifest
from cas.objects.keys import ObjectKind
from cas.refs.records import RefRecord
from cas.refs.stores import Stores
from cas.sync.transfer import RefUpdate, TransferReport, transfer

__all__ = [
    "TIERS_SECTION",
    "DrainReport",
    "PendingCheckpoint",
    "TierLag",
    "advance_latest",
    "drain_checkpoint",
    "pending_checkpoints",
    "tier_lag",
]

TIERS_SECTION = "tiers"
"""The local store's config section naming its remote tier and the checkpoint refs that drain
there: ``{"remote": url, "checkpoints": [glob, ...]}`` (``cas status`` reads it)."""
LATEST_DEPTH = 256
"""How far back the local ``latest``'s history is searched for a checkpoint the remote holds."""


@dataclass(frozen=True)
class PendingCheckpoint:
    """A local checkpoint ref the remote does not hold (or holds naming another manifest)."""

    ref: str
    target: Digest
    changed_at: float
    """When the local ref was set: the drain goes oldest first."""


@dataclass(frozen=True)
class TierLag:
    """What the remote tier still lacks: checkpoints, their chunk bytes, and since when."""

    saves: int = 0
    bytes: int = 0
    """Logical bytes of the chunks the pending checkpoints name that the remote lacks."""
    oldest: float | None = None
    """When the oldest pending checkpoint was saved (store clock), None if nothing is pending."""
    skipped: int = 0
    """Pending checkpoints the drain passes over: the remote's policy would not keep them."""
    error: str | None = None
    """Why the last drain attempt failed (the remote is down...), None after a success."""

    def age(self, now: float) -> float:
        """Seconds since the oldest pending checkpoint was saved (0 when nothing is pending)."""
        return max(0.0, now - self.oldest) if self.oldest is not None else 0.0

    def as_dict(self, now: float) -> dict[str, object]:
        """Plain values for ``--json``."""
        return {
            "saves": self.saves,
            "bytes": self.bytes,
            "oldest_age_seconds": round(self.age(now), 3),
            "skipped": self.skipped,
            "error": self.error,
        }


@dataclass
class DrainReport:
    """What draining one checkpoint did on the remote."""

    ref: str | None
    transfer: TransferReport | None
    latest: RefUpdate | None = None
    pointers: list[RefUpdate] = field(default_factory=list)


def pending_checkpoints(
    src: Stores,
    dst: Stores,
    selector: str,
    absent: Mapping[str, Digest] | None = None,
    present: MutableMapping[str, Digest] | None = None,
) -> list[PendingCheckpoint]:
    """The refs ``selector`` picks in ``src`` that ``dst`` lacks or holds at another manifest,
    oldest first. One read of ``dst`` per local ref (the local tier holds few, the remote many),
    except for those ``absent`` names at their current target: known not to be there (a drain
    passed them over), they are listed without asking; and those ``present`` names at their
    current target: known to be there (drained, or found there, by this caller before), they
    are not asked for again. ``present`` gains every ref found there now, and loses those
    ``src`` no longer has, so a run's drain asks for each checkpoint once, not once per save
    for as long as the local tier keeps it."""
    found = []
    listed = set()
    for record in src.refs.records(selector):
        listed.add(record.name)
        if present is not None and present.get(record.name) == record.target:
            continue
        if absent is not None and absent.get(record.name) == record.target:
            remote = None
        else:
            remote = dst.refs.try_get(record.name)
        if remote is not None and remote.target == record.target and present is not None:
            present[record.name] = record.target
        if remote is None or remote.target != record.target:
            changed = record.history[-1].time if record.history else 0.0
            found.append(PendingCheckpoint(record.name, record.target, changed))
    if present is not None:
        for name in [n for n in present if n not in listed]:
            del present[name]
    found.sort(key=lambda p: (p.changed_at, p.ref))
    return found


def drain_checkpoint(
    src: Stores,
    dst: Stores,
    ref: str | None,
    *,
    latest: str | None,
    pointers: Sequence[str] = (),
    hold_back: Collection[Digest] = (),
    jobs: int = 16,
    known: Collection[Digest] | None = None,
) -> DrainReport:
    """Push ``ref`` to ``dst``, then move ``latest`` and the ``pointers`` there (module docstring).

    ``hold_back``: targets still waiting to be drained; a pointer naming one waits for it.
    ``ref=None`` moves only ``latest`` and the pointers (a gate promoted between saves).
    ``known``: chunks ``dst`` held a moment ago, so none is asked for (``transfer``).
    """
    with dst.writers.hold("drain"):
        moved = (
            transfer(src, dst, [ref], jobs=jobs, op="drain", known=known)
            if ref is not None
            else None
        )
        report = DrainReport(ref, moved)
        if latest is not None:
            there = (
                {str(u.name): u.new for u in moved.refs if u.status != "conflict"} if moved else {}
            )
            report.latest = advance_latest(src, dst, latest, waiting=hold_back, there=there)
        report.pointers = push_pointers(src, dst, pointers, hold_back, jobs)
    return report


def advance_latest(
    src: Stores,
    dst: Stores,
    latest: str,
    *,
    waiting: Collection[Digest] = (),
    there: Mapping[str, Digest] | None = None,
) -> RefUpdate | None:
    """Point the remote's ``latest`` at the newest target of the local one's history whose
    checkpoint ref (the event's message) names the same manifest on ``dst``; None if it stays.

    What the caller knows is not asked of ``dst``: a target ``waiting`` to be drained is not
    there yet (the event is passed over), and ``there`` names checkpoint refs the caller has just
    pushed (ref -> target). Without that, each drain of a backlog read the remote ref of every
    newer checkpoint still waiting: quadratic in the backlog after S3 came back.
    """
    local = src.refs.try_get(latest)
    if local is None:
        return None
    remote = dst.refs.try_get(latest)
    current = remote.target if remote is not None else None
    pushed = there or {}
    for depth, event in enumerate(src.refs.events(local)):
        if depth >= LATEST_DEPTH or event.target == current:
            return None
        if not event.message or event.target in waiting:
            continue
        if pushed.get(event.message) != event.target and not _holds(
            dst, event.message, event.target
        ):
            continue
        dst.writers.check()  # fenced: a drain whose lease ran out moves no ref
        try:
            dst.refs.set(latest, event.target, expected=current, op="drain", message=event.message)
        except RefConflict:
            return RefUpdate(local.name, current, event.target, "conflict")
        return RefUpdate(
            local.name, current, event.target, "created" if current is None else "updated"
        )
    return None


def push_pointers(
    src: Stores, dst: Stores, selectors: Sequence[str], hold_back: Collection[Digest], jobs: int
) -> list[RefUpdate]:
    """Push the refs ``selectors`` pick whose target differs on ``dst`` and is not held back."""
    names = []
    for selector in selectors:
        for name in src.refs.names(selector):
            record = src.refs.try_get(name)
            if record is None or record.target in hold_back:
                continue
            remote = dst.refs.try_get(name)
            if remote is None or remote.target != record.target:
                names.append(name)
    if not names:
        return []
    try:
        return transfer(src, dst, names, jobs=jobs, op="drain").refs
    except NotFound:
        return []  # removed locally since listed: nothing of it is due on the remote


def tier_lag(src: Stores, dst: Stores, selector: str, skipped: int = 0) -> TierLag:
    """The exact lag of ``dst`` behind ``src`` for the refs ``selector`` picks: pending
    checkpoints, the bytes of the chunks they name that ``dst`` lacks, the oldest save time."""
    pending = pending_checkpoints(src, dst, selector)
    if not pending:
        return TierLag()
    sizes: dict[Digest, int] = {}
    oldest: float | None = None
    for item in pending:
        try:
            manifest = decode_manifest(src.objects.get_manifest(item.target))
        except CASError:
            continue  # damaged or gone: the drain reports it; the lag counts the rest
        saved = manifest.meta.get("saved_at", manifest.created_at)
        if isinstance(saved, (int, float)):
            oldest = float(saved) if oldest is None else min(oldest, float(saved))
        for chunk in manifest.chunk_refs():
            sizes[chunk.digest] = chunk.size
    missing, _ = dst.objects.missing(ObjectKind.CHUNK, list(sizes))
    return TierLag(
        len(pending), sum(sizes[d] for d in sizes if d in missing), oldest, skipped=skipped
    )


def _holds(dst: Stores, ref: str, target: Digest) -> bool:
    try:
        record: RefRecord | None = dst.refs.try_get(ref)
    except (CASError, ValueError):
        return False  # a message that is no ref name
    return record is not None and record.target == target
