"""``cas repair``: rebuild damaged refs in place from what the store still holds, keep the rest.

For each ref the selector picks, under the maintenance lock (GC does not run meanwhile):

- A record that cannot be decoded is moved under ``damaged/`` with its bytes kept
  (``cas.refs.damage.set_aside``). The ref is rebuilt at the first stored checkpoint manifest its
  bytes still name (a record writes its target first); failing that, at the newest event of the
  newest history segment its bytes name whose manifest is stored. A record whose name cannot be
  read (a long name's hashed key) is only moved aside.
- A record with unreadable history entries is copied under ``damaged/``, then rewritten without
  them (no new event).
- A ref whose manifest is missing is moved back to the newest earlier target in its history whose
  manifest is stored (a ``repair`` event records it). With none, it is left as it is and reported:
  another store may still hold the manifest (``cas verify --full --repair-from URL``), or
  ``cas rm`` removes the ref.

Nothing is deleted but the damaged record itself, after its copy is stored. ``dry_run`` plans the
same and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cas.digest import Digest
from cas.errors import CASError
from cas.model.manifest import decode_manifest
from cas.objects.keys import ObjectKind
from cas.refs import damage
from cas.refs.records import RefRecord, unpack_events
from cas.refs.store import REFLOG_MARK, ScannedRef
from cas.refs.stores import Stores


@dataclass(frozen=True)
class RefFix:
    """What repair found wrong with one ref and what it did (or, dry run, would do)."""

    ref: str
    problem: str
    action: str
    """``rebuilt``, ``cleaned``, ``rolled back``, ``set aside`` or ``none``."""
    detail: str
    fixed: bool
    """Whether the ref is usable afterwards (rebuilt, cleaned, rolled back)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return dict(self.__dict__)


@dataclass
class RefRepairReport:
    """Every damaged ref repair met, and what it did."""

    dry_run: bool
    refs: int = 0
    fixes: list[RefFix] = field(default_factory=list)

    @property
    def unfixed(self) -> list[RefFix]:
        """Refs repair could not make usable (set aside, or left as they were)."""
        return [f for f in self.fixes if not f.fixed]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "dry_run": self.dry_run,
            "refs": self.refs,
            "fixes": [f.to_dict() for f in self.fixes],
            "could_not": [f.ref for f in self.unfixed],
        }

    def summary(self) -> list[str]:
        """Human-readable lines: one per damaged ref, then a total."""
        done = "would repair" if self.dry_run else "repaired"
        lines = [
            f"{done} {f.ref}: {f.problem}; {f.action}: {f.detail}"
            if f.fixed
            else f"COULD NOT rebuild {f.ref}: {f.problem}; {f.detail}"
            for f in self.fixes
        ]
        lines.append(
            f"{self.refs} refs checked, {len(self.fixes)} damaged, "
            f"{len(self.fixes) - len(self.unfixed)} {'to repair' if self.dry_run else 'repaired'}, "
            f"{len(self.unfixed)} could not be rebuilt"
        )
        return lines


def repair_refs(
    stores: Stores,
    selector: str = "",
    *,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
) -> RefRepairReport:
    """Rebuild, clean or set aside every damaged ref ``selector`` picks (see the module)."""
    report = RefRepairReport(dry_run)
    if not dry_run:
        stores.check_deletes("repair")  # it moves records aside: a copy, then a delete
    with stores.maintenance.lock("repair", enabled=not dry_run):
        scanned = stores.refs.scan(selector)
        report.refs = len(scanned)
        for ref in scanned:
            try:
                fix = _repair_one(stores, ref, dry_run)
            except CASError as e:  # e.g. a writer moved the ref meanwhile: the others go on
                fix = RefFix(ref.label, "repair failed", "none", str(e).splitlines()[0], False)
            if fix is not None:
                report.fixes.append(fix)
            if progress is not None:
                progress(1)
    return report


def _repair_one(stores: Stores, scanned: ScannedRef, dry_run: bool) -> RefFix | None:
    if scanned.record is None:
        return _rebuild(stores, scanned, dry_run)
    record = scanned.record
    fix = None
    if record.damaged_events:
        fix = _clean(stores, scanned, record, dry_run)
    if not _readable(stores, record.target):
        fix = _roll_back(stores, record, dry_run)
    return fix


def _readable(stores: Stores, digest: Digest) -> bool:
    """Whether the manifest is stored and decodes (a checkpoint a ref can name)."""
    try:
        decode_manifest(stores.objects.get_manifest(digest))
    except CASError:
        return False
    return True


def _salvaged_target(stores: Stores, data: bytes) -> tuple[Digest | None, str]:
    """The checkpoint a damaged record's bytes still name, and where it came from."""
    segments = []
    salvaged = damage.salvage_digests(data)
    stored = stores.objects.has_many(ObjectKind.MANIFEST, salvaged) if salvaged else {}
    for digest in salvaged:
        if not stored[digest]:
            continue
        try:
            meta = decode_manifest(stores.objects.get_manifest(digest)).meta
        except CASError:
            continue
        if meta.get(REFLOG_MARK) == 1:
            segments.append(meta)
        else:
            return digest, "the target its record still names"
    for meta in reversed(segments):
        try:
            events = unpack_events(meta.get("events", ()))
        except Exception:
            continue
        for event in reversed(events):
            if _readable(stores, event.target):
                return event.target, "the newest readable event of its history segments"
    return None, ""


def _rebuild(stores: Stores, scanned: ScannedRef, dry_run: bool) -> RefFix | None:
    problem = f"record cannot be read ({str(scanned.error).splitlines()[0]})"
    raw = damage.read_raw(stores.refs, scanned.key)
    if raw is None:
        return None  # removed meanwhile
    if raw.data is None:  # nothing to salvage and nothing to keep: left for `cas rm`
        detail = "its bytes cannot be read back (another key?), so they cannot be kept; `cas rm`"
        return RefFix(scanned.label, problem, "none", detail, False)
    target, source = _salvaged_target(stores, raw.data)
    aside = "damaged/" + scanned.key + "/..." if dry_run else damage.set_aside(stores.refs, raw)
    if target is None or scanned.name is None:
        why = "its name cannot be read" if scanned.name is None else "it names no stored checkpoint"
        return RefFix(scanned.label, problem, "set aside", f"{why}; record kept at {aside}", False)
    if not dry_run:
        stores.refs.set(
            scanned.name, target, expected=None, op="repair", message=f"rebuilt; was {aside}"
        )
    detail = f"now names {target[:16]}, {source}; record kept at {aside}"
    return RefFix(scanned.label, problem, "rebuilt", detail, True)


def _clean(stores: Stores, scanned: ScannedRef, record: RefRecord, dry_run: bool) -> RefFix:
    count = len(record.damaged_events)
    problem = f"{count} unreadable history entries ({record.damaged_events[0].reason})"
    aside = "damaged/" + scanned.key + "/..."
    if not dry_run:
        raw = damage.read_raw(stores.refs, scanned.key)
        if raw is not None:
            aside = damage.keep_copy(stores.refs, raw)
            damage.drop_damaged_events(stores.refs, record)
    return RefFix(record.name, problem, "cleaned", f"dropped them; record kept at {aside}", True)


def _roll_back(stores: Stores, record: RefRecord, dry_run: bool) -> RefFix:
    problem = f"manifest {record.target[:16]} is missing or unreadable"
    try:
        for back, event in enumerate(stores.refs.events(record)):
            if back and event.target != record.target and _readable(stores, event.target):
                if not dry_run:
                    stores.refs.set(
                        record.name,
                        event.target,
                        expected=record.target,
                        op="repair",
                        message=f"manifest {record.target} missing",
                    )
                detail = f"now names {event.target[:16]} ({record.name}~{back})"
                return RefFix(record.name, problem, "rolled back", detail, True)
    except CASError:
        pass  # the rest of the history cannot be read: nothing older to go back to
    detail = (
        "no earlier target in its history is stored; left as it is "
        "(`cas verify --full --repair-from URL` may restore it, `cas rm` removes it)"
    )
    return RefFix(record.name, problem, "none", detail, False)
