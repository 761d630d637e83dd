"""Daily weights-only snapshots a stored retention policy asks for, taken before ``forget``.

For each ``DailySnapshot`` of the policy, today's ref (``snapshots/2026-11-26``, the date in the
policy's timezone) is made, if it does not exist yet, as a subset copy of the newest checkpoint
the snapshot's ``source`` selects: a new manifest naming some of that checkpoint's chunks, no
chunk written. So a cron job's ``cas forget --prune`` both takes the day's snapshot and retires
old ones (the snapshot's own rule, ``DailySnapshot.rule``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from cas.errors import FormatError
from cas.names import ref_matches
from cas.refs.listing import list_refs
from cas.refs.stores import Stores
from cas.retention.policy import DailySnapshot, RetentionPolicy, zone_of
from cas.retention.space import read_contents
from cas.retention.status import is_pointer

Copy = Callable[..., object]
"""``Repository.cp``: ``copy(src, dst, only=[...], message=...)``."""


@dataclass(frozen=True)
class SnapshotTaken:
    """What one daily snapshot setting did today."""

    ref: str
    source: str | None
    """The checkpoint copied (None: ``source`` selects no checkpoint)."""
    created: bool
    """False when today's snapshot already existed, nothing matched, or on a dry run."""
    note: str

    def to_dict(self) -> dict[str, object]:
        """Plain data for ``--json``."""
        return {"ref": self.ref, "source": self.source, "created": self.created, "note": self.note}


def take_daily_snapshots(
    stores: Stores, copy: Copy, policy: RetentionPolicy, now: float, *, dry_run: bool = False
) -> list[SnapshotTaken]:
    """Make today's snapshot for each of the policy's ``snapshots`` that lacks one, with
    ``copy`` (the store's ``Repository.cp``)."""
    day = dt.datetime.fromtimestamp(now, tz=zone_of(policy.timezone)).date()
    return [_take(stores, copy, snap, day, dry_run) for snap in policy.snapshots]


def _take(
    stores: Stores, copy: Copy, snap: DailySnapshot, day: dt.date, dry_run: bool
) -> SnapshotTaken:
    ref = snap.ref_for(day)
    try:
        if stores.refs.try_get(ref) is not None:
            return SnapshotTaken(ref, None, False, "exists")
    except FormatError:  # damaged: kept and reported by the plan, never replaced
        return SnapshotTaken(ref, None, False, "exists, but its record cannot be read")
    records = [
        r
        for r in list_refs(stores.refs).records
        if ref_matches(r.name, snap.source) and not is_pointer(r.name)
    ]
    # A damaged checkpoint is no snapshot's source; ``forget``'s plan names it.
    contents = read_contents(stores, records, damaged=[])
    if not contents:
        return SnapshotTaken(ref, None, False, f"no checkpoint matches {snap.source!r}")
    newest = max(contents, key=lambda c: (c.created_at, c.name))
    only = ", ".join(snap.only)
    if dry_run:
        return SnapshotTaken(ref, newest.name, False, f"would copy {newest.name} ({only})")
    copy(newest.name, ref, only=list(snap.only), message=f"daily snapshot of {newest.name}")
    return SnapshotTaken(ref, newest.name, True, f"copied {newest.name} ({only})")
