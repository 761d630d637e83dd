"""Garbage collection: mark from refs and recent ref history, sweep old unreachable objects.

``plan_gc`` computes a ``GCPlan`` and deletes nothing; ``GCPlan.execute()`` deletes what it lists
(``cas gc --dry-run`` only prints the plan). Planning, under the store's maintenance lock:

1. Read the writer leases first. The cutoff is ``now - grace``, lowered to
   ``oldest live lease start - margin`` while a writer is in flight (see ``cas.refs.leases``).
2. Roots: every ref's current target, every ref-history entry the ref moved on from less than
   ``reflog_window`` ago, and every manifest modified after the cutoff (a writer may be about to
   name it, or lost a ref race and was told to retry). Their chunks, delta bases included
   (``Manifest.chunk_digests``), are marked. Chunk payloads are never parsed (invariant 4).
3. List chunks and manifests with their mtimes: unmarked ones older than the cutoff are candidates.

Damage never stops the run: a ref record, history entry or root manifest that cannot be read is
kept and reported (``GCPlan.damaged``), what its bytes still name is kept, and when what it might
reach cannot be known the plan deletes nothing (``cas.retention.damage``); a ref whose manifest is
missing is set aside and reported (``broken_refs``).
Execution first fences the commits of writers whose leases expired (``RefStore.fence``), then
deletes manifests first, then chunks, so a manifest that is still stored never names a chunk this
run deleted; reachable objects are never touched, so killing GC at any point leaves every kept ref
loadable.

A writer may reuse (touch) a candidate after it was listed; the object store's sweeper
(``cas.objects.sweep``) re-checks every object right before it deletes it, inside announced sweep
windows (``cas.refs.sweeps``) that committing writers check, so a reuse in the moment between
the check and the delete aborts that commit instead of losing it (docs/gc.md, "Safety").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cas.digest import Digest
from cas.errors import CASError, FormatError, NotFound
from cas.model.manifest import decode_manifest
from cas.objects.keys import ObjectKind
from cas.objects.sweep import Window
from cas.refs.fences import FenceEntry
from cas.refs.leases import LeaseRecord
from cas.refs.records import FencedWriter, RefRecord
from cas.refs.stores import Stores
from cas.retention.damage import (
    Damage,
    damage_lines,
    damaged_event_roots,
    unreadable_history,
    unreadable_ref_roots,
    unreadable_root,
)
from cas.units import format_duration, format_size, parse_duration

GC_SECTION = "gc"
"""The ``StoreConfig.extra`` section holding ``GCSettings``."""
SWEEP_BATCH = 1024
"""Deletions per announced sweep window: a committing writer waits for at most one batch."""
REPLANS = 3
"""How often execution plans again when a fenced writer turns out to have published first."""
TMP_MIN_AGE = 600.0
"""Seconds a temp file is left alone whatever the grace period: a writer's temp file lives only
while it writes one blob (a lease's included, before GC can see that lease), and a grace of zero
must not delete it under the writer."""


@dataclass(frozen=True)
class GCSettings:
    """How old an unreachable object must be before GC deletes it, and how much history counts.

    ``grace``: unreachable objects modified less than this long ago are kept (writers that do not
    take leases, clock skew, coarse mtimes). ``reflog_window``: ref-history entries the ref moved
    on from less than this long ago keep their manifests alive (undo, and readers still loading a
    target that just moved). It is deliberately short: a ``latest`` ref moved at every save would otherwise keep every
    checkpoint of the window alive whatever the retention policy says.
    """

    grace: float = 3600.0
    reflog_window: float = 3600.0

    def __post_init__(self) -> None:
        if self.grace < 0 or self.reflog_window < 0:
            raise ValueError("grace and reflog_window must not be negative")

    @classmethod
    def from_config(cls, extra: dict[str, Any]) -> GCSettings:
        """Settings from ``StoreConfig.extra["gc"]``; durations may be strings like ``"2h"``."""
        section = extra.get(GC_SECTION) or {}
        if not isinstance(section, dict):
            raise FormatError("store config: 'gc' must be a map")
        try:
            return cls(
                **{
                    k: parse_duration(section[k])
                    for k in ("grace", "reflog_window")
                    if k in section
                }
            )
        except ValueError as e:
            raise FormatError(f"store config: bad 'gc' section: {e}") from e

    def to_config(self) -> dict[str, Any]:
        """The ``extra["gc"]`` section."""
        return {"grace": self.grace, "reflog_window": self.reflog_window}


@dataclass(frozen=True)
class GCPlan:
    """What a GC run will delete and why the rest stays. ``execute()`` carries it out."""

    now: float
    cutoff: float
    """Unreachable objects modified at or after this time are spared."""
    tmp_cutoff: float
    """Temp files older than this go (at least ``TMP_MIN_AGE`` before the plan)."""
    settings: GCSettings
    refs: int
    root_manifests: int
    history_manifests: int
    """Manifests kept only by ref-history entries inside the reflog window."""
    young_manifests: int
    """Unreachable manifests kept because they were modified after the cutoff."""
    live_leases: tuple[LeaseRecord, ...]
    reachable_chunks: int
    missing_chunks: int
    """Reachable chunks that are not in the store (``cas verify`` names the refs)."""
    stored_chunks: int
    stored_chunk_bytes: int
    spared_chunks: int
    spared_chunk_bytes: int
    chunks: tuple[str, ...]
    chunk_bytes: int
    manifests: tuple[str, ...]
    manifest_bytes: int
    tmp_files: tuple[str, ...]
    tmp_bytes: int
    expired_leases: tuple[LeaseRecord, ...]
    stores: Stores = field(repr=False, compare=False)
    waiting_bytes: int = 0
    """Bytes no current ref needs that GC keeps for now: unreachable objects younger than the
    grace period, and what only recent manifests or ref history inside the window reach."""
    waiting_until: float | None = None
    """When the last of ``waiting_bytes`` becomes collectable (later while a writer lease is live)."""
    broken_refs: tuple[str, ...] = ()
    """Refs whose manifest is missing: set aside (they protect nothing), reported."""
    kept_manifests: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    """Every manifest the plan keeps as a root."""
    stale_fences: tuple[FenceEntry, ...] = field(default=(), repr=False, compare=False)
    """Fence records no writer can need any more (docs/gc.md, "Removing fence records"): removed."""
    damaged: tuple[Damage, ...] = ()
    """Damaged refs, history entries and root manifests worked around, and what was kept."""
    withheld_bytes: int = 0
    """Bytes the plan would delete but does not, because some damage ``holds``."""

    @property
    def held(self) -> bool:
        """Whether damage whose reach cannot be known stops this run from deleting objects."""
        return any(d.holds for d in self.damaged)

    @property
    def freed_bytes(self) -> int:
        """Bytes the plan deletes (chunks, manifests and stale temp files)."""
        return self.chunk_bytes + self.manifest_bytes + self.tmp_bytes

    def to_dict(self, *, keys: bool = False) -> dict[str, Any]:
        """Plain data for ``--json``; ``keys=True`` adds every digest and file to delete."""
        doc: dict[str, Any] = {
            "now": self.now,
            "cutoff": self.cutoff,
            "grace": self.settings.grace,
            "reflog_window": self.settings.reflog_window,
            "refs": self.refs,
            "root_manifests": self.root_manifests,
            "history_manifests": self.history_manifests,
            "young_manifests": self.young_manifests,
            "live_leases": [_lease_dict(lease) for lease in self.live_leases],
            "stored_chunks": self.stored_chunks,
            "stored_chunk_bytes": self.stored_chunk_bytes,
            "reachable_chunks": self.reachable_chunks,
            "missing_chunks": self.missing_chunks,
            "spared_chunks": self.spared_chunks,
            "spared_chunk_bytes": self.spared_chunk_bytes,
            "delete_chunks": len(self.chunks),
            "delete_chunk_bytes": self.chunk_bytes,
            "delete_manifests": len(self.manifests),
            "delete_manifest_bytes": self.manifest_bytes,
            "delete_tmp_files": len(self.tmp_files),
            "delete_tmp_bytes": self.tmp_bytes,
            "reap_leases": len(self.expired_leases),
            "remove_fences": len(self.stale_fences),
            "broken_refs": list(self.broken_refs),
            "damaged": [d.to_dict() for d in self.damaged],
            "held": self.held,
            "withheld_bytes": self.withheld_bytes,
            "freed_bytes": self.freed_bytes,
            "waiting_bytes": self.waiting_bytes,
            "waiting_until": self.waiting_until,
        }
        if keys:
            doc.update(
                chunks=list(self.chunks), manifests=list(self.manifests), tmp=list(self.tmp_files)
            )
        return doc

    def execute(self, *, lock: bool = True) -> GCResult:
        """Fence dead writers' commits, then delete what the plan lists: manifests, then chunks,
        then temp files and dead leases.

        Each object is checked once more right before it goes: one modified after the plan's
        cutoff (a writer reused it meanwhile) is spared.
        """
        self.stores.check_deletes("gc")
        with self.stores.maintenance.lock("gc", enabled=lock):
            plan = self
            for _ in range(REPLANS):
                if plan._fence():
                    return plan._sweep()
                plan = plan_gc(self.stores, self.settings, lock=False)
            raise CASError("gc stopped, nothing deleted: fenced writers kept publishing refs")

    def _fence(self) -> bool:
        """Fence every ref an expired lease declared, so its writer can never publish; False if
        one was published after planning to a manifest the plan does not keep (plan again)."""
        for lease in self.expired_leases:
            writer = (FencedWriter.of(lease.writer, lease.who),)
            for ref in lease.commits:
                try:
                    target = self.stores.refs.fence(ref, writer, self.now)
                except CASError as e:
                    raise type(e)(f"gc stopped before deleting: fencing ref {ref!r}: {e}") from e
                if target is not None and target not in self.kept_manifests:
                    return False
        return True

    def _sweep(self) -> GCResult:
        started = time.monotonic()
        maintenance = self.stores.maintenance
        sweeper = self.stores.objects.sweeper()
        restored = sweeper.recover()
        windows = maintenance.sweep_windows()
        window = Window(windows.batch, windows.guard, SWEEP_BATCH)
        tally = _Tally()
        for candidates in (
            ((ObjectKind.MANIFEST, Digest(d)) for d in self.manifests),
            ((ObjectKind.CHUNK, Digest(d)) for d in self.chunks),
        ):
            for outcome in sweeper.remove_many(candidates, self.cutoff, window):
                tally.add(outcome.kind, outcome.status, outcome.size)
                if tally.seen % SWEEP_BATCH == 0:
                    maintenance.refresh_lock()
        tmp_files, tmp_bytes = sweeper.remove_tmp(self.tmp_files, self.tmp_cutoff)
        reaped = 0
        for lease in self.expired_leases:
            reaped += maintenance.reap(lease)
        fences_removed = 0
        for entry in self.stale_fences:
            try:
                fences_removed += maintenance.remove_fence(entry)
            except CASError as e:
                raise type(e)(f"gc: removing the fence record {entry.key!r}: {e}") from e
        return GCResult(
            deleted_chunks=tally.counts[ObjectKind.CHUNK],
            deleted_chunk_bytes=tally.bytes[ObjectKind.CHUNK],
            deleted_manifests=tally.counts[ObjectKind.MANIFEST],
            deleted_manifest_bytes=tally.bytes[ObjectKind.MANIFEST],
            spared=tally.spared,
            already_gone=tally.gone,
            deleted_tmp_files=tmp_files,
            deleted_tmp_bytes=tmp_bytes,
            reaped_leases=reaped,
            restored_from_trash=restored,
            removed_fences=fences_removed,
            seconds=time.monotonic() - started,
        )

    def summary(self) -> list[str]:
        """Human-readable lines describing the plan."""
        human_bytes = format_size
        window = format_duration(self.settings.reflog_window)
        lines = [
            f"gc plan: grace {format_duration(self.settings.grace)}, reflog window {window}, "
            f"cutoff {_when(self.cutoff)}",
            f"  roots: {self.refs} refs -> {self.root_manifests} manifests "
            f"({self.history_manifests} only by history within {window}, "
            f"{self.young_manifests} unreferenced but recent)",
            f"  chunks: {self.stored_chunks} stored ({human_bytes(self.stored_chunk_bytes)}), "
            f"{self.reachable_chunks} reachable, {self.spared_chunks} unreachable but recent "
            f"({human_bytes(self.spared_chunk_bytes)}) kept",
            f"  delete: {len(self.chunks)} chunks ({human_bytes(self.chunk_bytes)}), "
            f"{len(self.manifests)} manifests ({human_bytes(self.manifest_bytes)}), "
            f"{len(self.tmp_files)} stale temp files ({human_bytes(self.tmp_bytes)}), "
            f"{len(self.expired_leases)} expired leases",
        ]
        if self.stale_fences:
            lines[-1] += f", {len(self.stale_fences)} fence records no writer needs"
        for lease in self.live_leases:
            lines.append(
                f"  live writer lease {lease.writer} ({lease.purpose}) since {_when(lease.started)}: "
                "what it writes is kept"
            )
        if self.waiting_bytes and self.waiting_until is not None:
            lines.append(f"  waiting: {self.waiting_line()}")
        for name in self.broken_refs:
            lines.append(
                f"  WARNING: ref {name!r} names a missing manifest: set aside, it keeps nothing; "
                "run `cas verify`"
            )
        lines.extend(damage_lines(self.damaged, self.withheld_bytes))
        if self.missing_chunks:
            lines.append(
                f"  WARNING: {self.missing_chunks} reachable chunks are missing; run `cas verify`"
            )
        return lines

    def waiting_line(self) -> str:
        """What waits for the grace period or the reflog window, and until when."""
        until = self.waiting_until if self.waiting_until is not None else self.now
        return (
            f"{format_size(self.waiting_bytes)} no ref needs, kept by the grace period "
            f"{format_duration(self.settings.grace)} or the reflog window; collectable by "
            f"{_when(until)} (in {format_duration(max(0.0, until - self.now))}: run `cas gc` then)"
        )


@dataclass(frozen=True)
class GCResult:
    """What ``GCPlan.execute`` did."""

    deleted_chunks: int
    deleted_chunk_bytes: int
    deleted_manifests: int
    deleted_manifest_bytes: int
    spared: int
    """Candidates a writer reused between planning and deletion: kept."""
    already_gone: int
    deleted_tmp_files: int
    deleted_tmp_bytes: int
    reaped_leases: int
    restored_from_trash: int
    """Objects a killed earlier run left in ``tmp/gc-trash``, put back."""
    seconds: float
    removed_fences: int = 0
    """Fence records removed because no writer they fence can write again."""

    @property
    def freed_bytes(self) -> int:
        """Bytes deleted."""
        return self.deleted_chunk_bytes + self.deleted_manifest_bytes + self.deleted_tmp_bytes


class _Tally:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(ObjectKind, 0)
        self.bytes = dict.fromkeys(ObjectKind, 0)
        self.spared = self.gone = self.seen = 0

    def add(self, kind: ObjectKind, outcome: str, size: int) -> None:
        self.seen += 1
        if outcome == "deleted":
            self.counts[kind] += 1
            self.bytes[kind] += size
        elif outcome == "spared":
            self.spared += 1
        else:
            self.gone += 1


def plan_gc(
    stores: Stores,
    settings: GCSettings,
    *,
    clock: Callable[[], float] | None = None,
    lock: bool = True,
) -> GCPlan:
    """Mark and list; return what a sweep would delete. Deletes nothing; raises if a ref or root
    manifest cannot be read. ``clock`` overrides the store's clock (it must agree with the mtimes).
    Without ``lock`` (a report on a store opened read-only) the plan is a snapshot for reading
    only, and an interrupted sweep is left for the next locked run to recover.
    """
    maintenance = stores.maintenance
    margin = maintenance.settings.margin
    with maintenance.lock("gc", enabled=lock):
        sweeper = stores.objects.sweeper()
        if lock:
            sweeper.recover()
        now = clock() if clock is not None else maintenance.store_time()
        leases = maintenance.leases()
        live = tuple(lease for lease in leases if lease.live(now, margin))
        expired = tuple(lease for lease in leases if not lease.live(now, margin))
        cutoff = now - settings.grace
        if live:
            cutoff = min(cutoff, min(lease.started for lease in live) - margin)
        records, damaged, salvaged = _read_refs(stores)
        roots: dict[str, str] = {}
        for record in records:
            roots.setdefault(record.target, f"ref {record.name!r}")
        for digest, owner in salvaged.items():
            roots.setdefault(digest, owner)
        current = set(roots)
        segments: set[str] = set()
        for record in records:
            # An entry's age counts from when the ref moved on from it (git's reflog does the
            # same): a target overwritten a minute ago is kept however long it was current.
            try:
                for back, event in stores.refs.superseded_since(
                    record, now, now - settings.reflog_window
                ):
                    roots.setdefault(event.target, f"ref {record.name}~{back}")
            except CASError as e:
                damaged.append(unreadable_history(record.name, e))
            for sealed in record.sealed:
                segments.add(sealed.digest)
                roots.setdefault(sealed.digest, f"ref {record.name!r} (sealed history)")
        manifest_infos = {
            m.digest: (m.size, m.mtime) for m in stores.objects.list_objects(ObjectKind.MANIFEST)
        }
        young = {
            d for d, (_, mtime) in manifest_infos.items() if mtime >= cutoff and d not in roots
        }
        for digest in young:
            roots[digest] = "a recently written manifest"
        # Marked apart, so that what only the grace period or history keeps can be told.
        needed, found, missing = _mark(stores, {d: roots[d] for d in current}, current, damaged)
        held, found_held, _ = _mark(
            stores, {d: w for d, w in roots.items() if d not in current}, current, damaged
        )
        marked, found = needed | held, found + found_held
        deleted_manifests = sorted(
            d for d, (_, mtime) in manifest_infos.items() if d not in roots and mtime < cutoff
        )
        chunk_scan = _scan_chunks(stores, marked, cutoff, held - needed, settings.grace)
        withheld = 0
        if any(d.holds for d in damaged):
            withheld = chunk_scan.candidate_bytes + sum(
                manifest_infos[d][0] for d in deleted_manifests
            )
            chunk_scan.candidates, chunk_scan.candidate_bytes, deleted_manifests = [], 0, []
        tmp_cutoff = min(cutoff, now - TMP_MIN_AGE)
        tmp = sweeper.stale_tmp(tmp_cutoff)
        stale_fences = tuple(maintenance.stale_fences(now))
        waiting = _Waiting(chunk_scan.waiting_bytes, chunk_scan.waiting_until)
        for root in roots.keys() - current - segments:
            if root in manifest_infos:
                size, mtime = manifest_infos[Digest(root)]
                history = root not in young
                waiting.add(
                    size, now + settings.reflog_window if history else mtime + settings.grace
                )
    return GCPlan(
        now=now,
        cutoff=cutoff,
        tmp_cutoff=tmp_cutoff,
        settings=settings,
        refs=len(records),
        root_manifests=found,
        history_manifests=len(
            {d for d in roots if d not in current and d not in young and d not in segments}
        ),
        young_manifests=len(young),
        live_leases=live,
        reachable_chunks=len(marked),
        missing_chunks=len(marked) - chunk_scan.reachable_found,
        stored_chunks=chunk_scan.stored,
        stored_chunk_bytes=chunk_scan.stored_bytes,
        spared_chunks=chunk_scan.spared,
        spared_chunk_bytes=chunk_scan.spared_bytes,
        chunks=tuple(chunk_scan.candidates),
        chunk_bytes=chunk_scan.candidate_bytes,
        manifests=tuple(deleted_manifests),
        manifest_bytes=sum(manifest_infos[d][0] for d in deleted_manifests),
        tmp_files=tuple(name for name, _ in tmp),
        tmp_bytes=sum(size for _, size in tmp),
        expired_leases=expired,
        stores=stores,
        waiting_bytes=waiting.nbytes,
        waiting_until=waiting.until,
        broken_refs=tuple(sorted(r.name for r in records if r.target in missing)),
        damaged=tuple(damaged),
        withheld_bytes=withheld,
        kept_manifests=frozenset(d for d in roots if d not in missing),
        stale_fences=stale_fences,
    )


def _read_refs(stores: Stores) -> tuple[list[RefRecord], list[Damage], dict[str, str]]:
    """Every readable ref; the damage found; the manifests damaged records and history entries
    still name (kept as roots): a ref GC cannot read could be protecting anything."""
    records: list[RefRecord] = []
    damaged: list[Damage] = []
    salvaged: dict[str, str] = {}
    for scanned in stores.refs.scan():
        if scanned.record is None:
            found, damage = unreadable_ref_roots(stores, scanned)
            damaged.append(damage)
        else:
            records.append(scanned.record)
            found, damages = damaged_event_roots(stores, scanned.record)
            damaged.extend(damages)
        for digest in found:
            salvaged.setdefault(digest, f"damaged ref {scanned.label!r} (salvaged)")
    return records, damaged, salvaged


def _mark(
    stores: Stores, roots: dict[str, str], current: set[str], damaged: list[Damage]
) -> tuple[set[str], int, set[str]]:
    """Chunks named by the root manifests, how many roots were read, and the refs' targets that
    are missing (set aside: they can keep nothing). A corrupt root is added to ``damaged``."""

    def read(digest: str) -> frozenset[str] | CASError | None:
        try:
            manifest = decode_manifest(stores.objects.get_manifest(Digest(digest)))
        except NotFound:
            return None  # history, a recent unreferenced manifest, or a broken ref: keeps nothing
        except CASError as e:
            return e
        return frozenset(manifest.chunk_digests())

    marked: set[str] = set()
    found = 0
    missing: set[str] = set()
    digests = list(roots)
    for digest, chunks in zip(digests, stores.pool.map(read, digests), strict=True):
        if isinstance(chunks, CASError):
            damaged.append(unreadable_root(roots[digest], digest, chunks))
        elif chunks is not None:
            found += 1
            marked |= chunks
        elif digest in current:
            missing.add(digest)
    return marked, found, missing


@dataclass
class _Waiting:
    """Bytes kept only by time (grace, reflog window), and when the last of them may go."""

    nbytes: int = 0
    until: float | None = None

    def add(self, size: int, ready: float) -> None:
        self.nbytes += size
        self.until = ready if self.until is None else max(self.until, ready)


@dataclass
class _ChunkScan:
    stored: int = 0
    stored_bytes: int = 0
    reachable_found: int = 0
    spared: int = 0
    spared_bytes: int = 0
    candidates: list[str] = field(default_factory=list)
    candidate_bytes: int = 0
    waiting_bytes: int = 0
    waiting_until: float | None = None


def _scan_chunks(
    stores: Stores, marked: set[str], cutoff: float, held: set[str], grace: float
) -> _ChunkScan:
    """Classify every stored chunk; ``held`` are reachable only from roots that time keeps."""
    scan = _ChunkScan()
    waiting = _Waiting()
    for chunk in stores.objects.list_objects(ObjectKind.CHUNK):
        scan.stored += 1
        scan.stored_bytes += chunk.size
        if chunk.digest in marked:
            scan.reachable_found += 1
            if chunk.digest in held:
                waiting.add(chunk.size, chunk.mtime + grace)
        elif chunk.mtime >= cutoff:
            scan.spared += 1
            scan.spared_bytes += chunk.size
            waiting.add(chunk.size, chunk.mtime + grace)
        else:
            scan.candidates.append(chunk.digest)
            scan.candidate_bytes += chunk.size
    scan.waiting_bytes, scan.waiting_until = waiting.nbytes, waiting.until
    return scan


def _lease_dict(lease: LeaseRecord) -> dict[str, Any]:
    return {
        "writer": lease.writer,
        "host": lease.host,
        "pid": lease.pid,
        "started": lease.started,
        "expires": lease.expires,
        "purpose": lease.purpose,
    }


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
