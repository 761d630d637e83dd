"""What GC keeps for damage it works around: the rule that no deletion rests on a guess.

Every housekeeping command proceeds around a damaged ref record, manifest or history entry and
names it (docs/gc.md, "Damage"). For GC the question is what the damage might still reach:

- An unreadable ref record keeps every stored manifest its bytes still name
  (``cas.refs.damage.salvage_digests``), with their chunks, as if the ref named them, and the
  targets of the history segments among them. When its bytes name no checkpoint manifest (only
  history, or nothing), its current target cannot be known: the run deletes nothing (``holds``).
- An unreadable inline history entry keeps the manifests its bytes still name, and nothing else:
  history keeps checkpoints only for the reflog window, and an entry that spells no digest names
  no object (an object's name is its digest).
- A root manifest that cannot be read (corrupt, quarantined), or a sealed history segment inside
  the reflog window that cannot be read, hides what it names; both may be restored from another
  store (``cas verify --repair-from``), so the run deletes nothing meanwhile.

A ref whose current manifest is missing reaches nothing more and is set aside (``broken_refs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from cas.digest import Digest
from cas.errors import CASError
from cas.model.manifest import decode_manifest
from cas.objects.keys import ObjectKind
from cas.refs.damage import read_raw, salvage_digests
from cas.refs.records import RefRecord, unpack_events
from cas.refs.store import REFLOG_MARK, ScannedRef
from cas.refs.stores import Stores
from cas.units import format_size


@dataclass(frozen=True)
class Damage:
    """One damaged thing a run worked around: which ref, what is wrong and what was done."""

    ref: str
    problem: str
    kept: str
    """What GC did about it: the manifests it kept, or why it deleted nothing."""
    holds: bool = False
    """Whether it stops this run from deleting any object (its reach cannot be known)."""

    def __str__(self) -> str:
        return f"{self.ref}: {self.problem}; {self.kept}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {"ref": self.ref, "problem": self.problem, "kept": self.kept, "holds": self.holds}


def _first_line(error: object) -> str:
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def _stored(stores: Stores, digests: list[Digest]) -> list[Digest]:
    if not digests:
        return []
    present = stores.objects.has_many(ObjectKind.MANIFEST, digests)
    return [d for d in digests if present[d]]


def _segment_targets(stores: Stores, digest: Digest) -> list[Digest] | None:
    """The targets a history segment's events name; None when the manifest is no segment (or
    cannot be read: then GC's marking reports it)."""
    try:
        meta = decode_manifest(stores.objects.get_manifest(digest)).meta
    except CASError:
        return None
    if meta.get(REFLOG_MARK) != 1:
        return None
    try:
        return [e.target for e in unpack_events(meta.get("events", ()))]
    except Exception:
        return []


def unreadable_ref_roots(stores: Stores, scanned: ScannedRef) -> tuple[list[Digest], Damage]:
    """The stored manifests a ref record that cannot be decoded still names (and those its
    history segments name), and the report. Its current target is known to be kept only when
    a checkpoint manifest, not just history, is among them."""
    raw = read_raw(stores.refs, scanned.key)
    found = _stored(stores, salvage_digests(raw.data)) if raw is not None and raw.data else []
    problem = f"ref record cannot be read: {_first_line(scanned.error)}"
    checkpoints = []
    for digest in list(found):
        targets = _segment_targets(stores, digest)
        if targets is None:
            checkpoints.append(digest)
        else:
            found.extend(d for d in _stored(stores, targets) if d not in found)
    if checkpoints:
        kept = f"kept the {len(found)} manifests its bytes still name"
        return found, Damage(scanned.label, problem, kept)
    kept = (
        f"kept the {len(found)} manifests its history names, but its bytes name no checkpoint, "
        "so gc deletes nothing (`cas repair` or `cas rm`)"
        if found
        else "its bytes name no stored manifest, so gc deletes nothing (`cas repair` or `cas rm`)"
    )
    return found, Damage(scanned.label, problem, kept, holds=True)


def damaged_event_roots(stores: Stores, record: RefRecord) -> tuple[list[Digest], list[Damage]]:
    """The stored manifests a readable record's unreadable history entries still name."""
    roots: list[Digest] = []
    damages = []
    for event in record.damaged_events:
        try:
            data = msgpack.packb(event.raw)
        except (TypeError, ValueError):
            data = repr(event.raw).encode()
        found = _stored(stores, salvage_digests(data))
        roots.extend(found)
        kept = f"kept the {len(found)} manifests it names" if found else "it names no object"
        damages.append(Damage(record.name, f"history entry {event.reason}", kept))
    return roots, damages


def unreadable_history(ref: str, error: object) -> Damage:
    """A sealed segment inside the reflog window that cannot be read: the run deletes nothing."""
    return Damage(
        ref,
        f"history cannot be read: {_first_line(error)}",
        "gc deletes nothing (`cas verify --repair-from` or `cas repair`)",
        holds=True,
    )


def unreadable_root(what: str, digest: str, error: object) -> Damage:
    """A root manifest that cannot be read (not missing): the run deletes nothing."""
    return Damage(
        what,
        f"manifest {digest[:16]} cannot be read: {_first_line(error)}",
        "gc deletes nothing (`cas verify --repair-from` restores it)",
        holds=True,
    )


def damage_lines(damaged: tuple[Damage, ...], withheld: int) -> list[str]:
    """The warning lines of a GC plan's summary about the damage it worked around."""
    lines = [f"  WARNING: damaged {d}" for d in damaged]
    if any(d.holds for d in damaged):
        lines.append(
            f"  WARNING: deleting nothing ({format_size(withheld)} withheld) while damage hides "
            "what it reaches"
        )
    return lines
