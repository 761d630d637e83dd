"""Planning retention: a policy's rules applied to every ref, as a ForgetPlan, and executing it.

``plan_forget`` reads every ref's manifest (a ref whose record or manifest cannot be read is kept,
counted by no rule and reported in ``ForgetPlan.damaged``: the others are planned as if it were
not there), groups the refs each rule selects, marks them
protected / kept / dropped as ``cas.retention.policy`` describes, then enforces the size budget
with reference counts over the kept refs (``cas.retention.space.Accounting``), so each dropped
ref is charged only the bytes no kept ref shares. A plan changes nothing until ``execute()``.
Execution takes the maintenance lock, skips any ref that moved since planning (it is
compare-and-swap: a plan made on stale state never removes a newer checkpoint), appends
eviction-log records, then removes the refs. Chunks are only freed by ``cas gc`` afterwards,
once the grace period and reflog window allow.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cas.digest import Digest
from cas.errors import NotFound, RefConflict
from cas.names import ref_matches
from cas.refs.listing import DamagedRef, list_refs
from cas.refs.records import RefRecord
from cas.refs.stores import Stores
from cas.retention.evictions import append_evictions
from cas.retention.policy import PERIODS, RetentionPolicy, Rule, zone_of
from cas.retention.space import Accounting, RefContent, read_contents
from cas.units import format_duration, format_size


@dataclass(frozen=True)
class RefDecision:
    """Keep or drop one ref, with the reasons. ``bytes``: what dropping it frees (in plan order)
    for a dropped ref; its exclusive bytes among the kept refs for a kept one."""

    ref: str
    manifest: Digest
    time: float
    rule: str
    group: str
    keep: bool
    protected: bool
    reasons: tuple[str, ...]
    bytes: int
    changed: float | None = None
    """When the ref was last set, at planning: a ref set again since (even to the same manifest,
    as a re-promotion does) is not removed."""


@dataclass(frozen=True)
class ForgetResult:
    """What ``ForgetPlan.execute`` did."""

    removed: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    """``(ref, why)`` for refs not removed: moved since the plan, or already gone."""
    logged: int
    damaged: tuple[DamagedRef, ...] = ()
    """Refs whose record or manifest cannot be read: kept, outside every rule's count."""


@dataclass(frozen=True)
class ForgetPlan:
    """Every ref's fate under a policy at time ``now``, and the store size before and after."""

    now: float
    decisions: tuple[RefDecision, ...]
    bytes_before: int
    bytes_after: int
    budget: int
    warnings: tuple[str, ...]
    evictions: tuple[tuple[str, dict[str, Any]], ...]
    """``(log name, record)`` appended to eviction logs before the refs go."""
    stores: Stores = field(repr=False, compare=False)
    take_snapshots: Callable[[], object] | None = field(default=None, repr=False, compare=False)
    """Takes the policy's missing daily snapshots; ``execute`` calls it before removing any ref,
    as ``Repository.forget`` does (``Repository.plan_forget`` sets it)."""
    damaged: tuple[DamagedRef, ...] = ()
    """Refs whose record or manifest cannot be read: kept, outside every rule's count."""

    @property
    def dropped(self) -> tuple[RefDecision, ...]:
        """Refs the plan removes."""
        return tuple(d for d in self.decisions if not d.keep)

    @property
    def kept(self) -> tuple[RefDecision, ...]:
        """Refs the plan keeps."""
        return tuple(d for d in self.decisions if d.keep)

    @property
    def freed_bytes(self) -> int:
        """Stored bytes no kept ref reaches afterwards (what ``cas gc`` can then free)."""
        return self.bytes_before - self.bytes_after

    def decision(self, ref: str) -> RefDecision:
        """The decision about one ref."""
        for d in self.decisions:
            if d.ref == ref:
                return d
        raise NotFound(f"the plan has no ref {ref!r}")

    def execute(self, *, lock: bool = True) -> ForgetResult:
        """Log evictions, then remove the dropped refs (each only if it still names its manifest)."""
        refs = self.stores.refs
        if self.dropped:
            self.stores.check_deletes("forget")
        if self.take_snapshots is not None:
            self.take_snapshots()  # a snapshot of a ref this plan drops is taken before it goes
        with self.stores.maintenance.lock("forget", enabled=lock):
            skipped: list[tuple[str, str]] = []
            still: list[RefDecision] = []
            for d in self.dropped:
                record = refs.try_get(d.ref)
                if record is None:
                    skipped.append((d.ref, "already gone"))
                elif record.target != d.manifest or _set_since(record, d.changed):
                    skipped.append((d.ref, "moved since the plan"))
                else:
                    still.append(d)
            names = {d.ref for d in still}
            per_log: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for log, record_doc in self.evictions:
                if record_doc.get("ref") in names:
                    per_log[log].append(record_doc)
            logged = sum(append_evictions(refs, log, docs) for log, docs in per_log.items())
            removed = []
            for d in still:
                try:
                    refs.delete(d.ref, expected=d.manifest, changed_at=d.changed)
                    removed.append(d.ref)
                except RefConflict:
                    skipped.append((d.ref, "moved since the plan"))
                except NotFound:
                    skipped.append((d.ref, "already gone"))
        return ForgetResult(tuple(removed), tuple(skipped), logged, self.damaged)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "now": self.now,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "freed_bytes": self.freed_bytes,
            "budget": self.budget,
            "warnings": list(self.warnings),
            "drop": [_decision_dict(d) for d in self.dropped],
            "keep": [_decision_dict(d) for d in self.kept],
            "damaged": [d.to_dict() for d in self.damaged],
        }

    def summary(self, *, show_kept: bool = True) -> list[str]:
        """Human-readable lines: one per ref, then totals and warnings."""
        lines = []
        for d in self.decisions:
            if d.keep and not show_kept:
                continue
            mark = "keep" if d.keep else "DROP"
            size = f"frees {format_size(d.bytes)}" if not d.keep else f"excl {format_size(d.bytes)}"
            lines.append(f"{mark}  {_when(d.time)}  {size:>16}  {d.ref}  ({'; '.join(d.reasons)})")
        budget = f" / budget {format_size(self.budget)}" if self.budget else ""
        lines.append(
            f"{len(self.dropped)} refs to remove, {len(self.kept)} kept; stored "
            f"{format_size(self.bytes_before)} -> {format_size(self.bytes_after)}{budget} "
            f"(freed by `cas gc` after the grace period)"
        )
        lines.extend(f"WARNING: {w}" for w in self.warnings)
        lines.extend(
            f"WARNING: kept damaged ref {d.ref}: {d.error.splitlines()[0] if d.error else '?'}"
            for d in self.damaged
        )
        return lines


def _set_since(record: RefRecord, changed: float | None) -> bool:
    """Whether the ref was set again after ``changed`` (when the plan read it)."""
    return changed is not None and bool(record.history) and record.history[-1].time != changed


def _decision_dict(d: RefDecision) -> dict[str, Any]:
    return {
        "ref": d.ref,
        "manifest": d.manifest,
        "time": d.time,
        "rule": d.rule,
        "group": d.group,
        "protected": d.protected,
        "reasons": list(d.reasons),
        "bytes": d.bytes,
    }


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts))


def _build_plan(
    stores: Stores,
    policy: RetentionPolicy,
    now: float,
    entries: list[_Entry],
    accounting: Accounting,
    warnings: list[str],
) -> ForgetPlan:
    """Freeze the planner's working state into a ForgetPlan."""
    decisions = []
    evictions: list[tuple[str, dict[str, Any]]] = []
    for entry in sorted(
        entries, key=lambda e: (e.rule is None, e.rule or 0, e.group, -e.time, e.name)
    ):
        rule = policy.rules[entry.rule] if entry.rule is not None else None
        keep = not entry.dropped
        reasons = entry.protected + entry.kept if keep else entry.dropped
        decisions.append(
            RefDecision(
                ref=entry.name,
                manifest=entry.content.target,
                time=entry.time,
                rule=rule.label if rule else "",
                group=entry.group,
                keep=keep,
                protected=bool(entry.protected),
                reasons=tuple(reasons),
                bytes=accounting.exclusive(entry.content) if keep else entry.frees,
                changed=history[-1].time if (history := entry.content.record.history) else None,
            )
        )
        if not keep and rule is not None and rule.eviction_log:
            evictions.append(
                (
                    rule.eviction_log,
                    {
                        "evicted_at": now,
                        "ref": entry.name,
                        "manifest": entry.content.target,
                        "time": entry.time,
                        "rule": rule.label,
                        "reason": "; ".join(entry.dropped),
                        "meta": entry.content.meta,
                    },
                )
            )
    evictions.sort(key=lambda pair: (pair[1]["time"], pair[1]["ref"]))
    return ForgetPlan(
        now=now,
        decisions=tuple(decisions),
        bytes_before=accounting.before,
        bytes_after=accounting.total,
        budget=policy.max_total_bytes,
        warnings=tuple(warnings),
        evictions=tuple(evictions),
        stores=stores,
    )


@dataclass
class _Entry:
    content: RefContent
    rule: int | None
    group: str
    time: float
    protected: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    frees: int = 0

    @property
    def name(self) -> str:
        return self.content.name


def plan_forget(stores: Stores, policy: RetentionPolicy, *, now: float | None = None) -> ForgetPlan:
    """Decide, for every ref, keep or drop and why; sizes say what dropping frees."""
    now = stores.clock() if now is None else now
    # Daily snapshots are retained by rules of their own, ahead of the policy's.
    policy = replace(policy, rules=policy.effective_rules(), snapshots=())
    zone = zone_of(policy.timezone)
    listing = list_refs(stores.refs)
    damaged = list(listing.damaged)
    contents = read_contents(stores, listing.records, damaged)
    entries = [_classify(policy, c) for c in contents]
    groups: dict[tuple[int, str], list[_Entry]] = defaultdict(list)
    for entry in entries:
        if entry.rule is not None:
            groups[(entry.rule, entry.group)].append(entry)
    warnings: list[str] = []
    for (index, group), members in sorted(groups.items()):
        members.sort(key=lambda e: (e.time, e.name), reverse=True)
        rule = policy.rules[index]
        _protect(rule, policy, members, contents, now, zone)
        warnings.extend(_unranked(rule, group, members))
        _keep(rule, members, now, zone)
        for entry in members:
            if not entry.protected and not entry.kept:
                entry.dropped.append("not kept by " + ", ".join(rule.keep_limits()))
        warnings.extend(_cap(rule, group, members))
    sizes = stores.objects.stored_sizes({o for c in contents for o in c.objects})
    accounting = Accounting(sizes, contents)
    for entry in sorted((e for e in entries if e.dropped), key=lambda e: (e.time, e.name)):
        entry.frees = accounting.drop(entry.content)
    if policy.max_total_bytes and accounting.total > policy.max_total_bytes:
        warnings.extend(_enforce_budget(policy, entries, accounting))
    plan = _build_plan(stores, policy, now, entries, accounting, warnings)
    return replace(plan, damaged=tuple(sorted(damaged, key=lambda d: d.ref)))


def _classify(policy: RetentionPolicy, content: RefContent) -> _Entry:
    index = next(
        (i for i, r in enumerate(policy.rules) if ref_matches(content.name, r.select)), None
    )
    rule = policy.rules[index] if index is not None else None
    when = content.created_at
    if rule is not None and rule.time == "ref" and content.record.history:
        when = content.record.history[-1].time
    entry = _Entry(content, index, rule.group_of(content.name) if rule else "", when)
    for pattern in policy.protect:
        if ref_matches(content.name, pattern):
            entry.protected.append(f"protected by policy ({pattern})")
    if rule is None:
        entry.protected.append("no rule selects it")
    return entry


def _unranked(rule: Rule, group: str, members: list[_Entry]) -> list[str]:
    """A warning per ``keep_best`` metric that no checkpoint of the group carries: such a rule
    protects nothing, which is never what its author meant (a misspelt or unrecorded metric)."""
    where = f"{rule.name or rule.select}" + (f" [{group}]" if group else "")
    return [
        f"keep-best {best.metric}: no checkpoint {where} selects records metric "
        f"{best.metric!r}, so it protects none (is the metric stored in meta['metrics']?)"
        for best in rule.keep_best
        if members and all(best.value(e.content.meta) is None for e in members)
    ]


def _protect(
    rule: Rule,
    policy: RetentionPolicy,
    members: list[_Entry],
    contents: list[RefContent],
    now: float,
    zone: dt.tzinfo | None,
) -> None:
    if rule.keep_latest and members:
        members[0].protected.append("latest of its group")
    pointers = {
        c.target: c.name
        for c in contents
        if any(ref_matches(c.name, p) for p in rule.protect_targets_of)
    }
    for entry in members:
        entry.protected.extend(
            f"protected ({p})" for p in rule.protect if ref_matches(entry.name, p)
        )
        pointer = pointers.get(entry.content.target)
        if pointer is not None and pointer != entry.name:
            entry.protected.append(f"same checkpoint as {pointer}")
        age = now - entry.time
        if age < policy.min_age:
            entry.protected.append(f"younger than min-age {format_duration(policy.min_age)}")
        if age < rule.protect_within:
            entry.protected.append(f"younger than {format_duration(rule.protect_within)}")
    for best in rule.keep_best:
        scored = [(v, e) for e in members if (v := best.value(e.content.meta)) is not None]
        sign = 1.0 if best.mode == "min" else -1.0
        scored.sort(key=lambda pair: (sign * pair[0], -pair[1].time))
        for value, entry in scored[: best.count]:
            entry.protected.append(f"best {best.metric}={value:g} ({best.mode})")
    if rule.protect_days:
        today = _local(now, zone).date()
        names = {0: "today", 1: "yesterday"}
        seen: set[dt.date] = set()
        for entry in members:
            day = _local(entry.time, zone).date()
            back = (today - day).days
            if 0 <= back < rule.protect_days and day not in seen:
                seen.add(day)
                entry.protected.append(f"newest of {day} ({names.get(back, f'{back} days ago')})")


def _keep(rule: Rule, members: list[_Entry], now: float, zone: dt.tzinfo | None) -> None:
    if not rule.has_keep_limits:
        for entry in members:
            entry.kept.append(
                f"within max-count {rule.max_count}" if rule.max_count else "no keep-* limit"
            )
        return
    for entry in members[: rule.keep_last]:
        entry.kept.append(f"last {rule.keep_last}")
    if rule.keep_within:
        for entry in members:
            if now - entry.time <= rule.keep_within:
                entry.kept.append(f"within {format_duration(rule.keep_within)}")
    for attr, word in PERIODS:
        limit = getattr(rule, attr)
        buckets: set[str] = set()
        for entry in members:
            if len(buckets) >= limit:
                break
            bucket = _bucket(word, _local(entry.time, zone))
            if bucket not in buckets:
                buckets.add(bucket)
                entry.kept.append(f"{word} {bucket}")


def _cap(rule: Rule, group: str, members: list[_Entry]) -> list[str]:
    if not rule.max_count:
        return []
    remaining = [e for e in members if not e.dropped]
    excess = len(remaining) - rule.max_count
    for entry in reversed(remaining):
        if excess <= 0:
            break
        if not entry.protected:
            entry.dropped.append(f"over max-count {rule.max_count} (oldest unprotected)")
            excess -= 1
    if excess > 0:
        return [
            f"group {group or '/'} keeps {rule.max_count + excess} refs, over max-count "
            f"{rule.max_count}: the others are protected"
        ]
    return []


def _enforce_budget(
    policy: RetentionPolicy, entries: list[_Entry], accounting: Accounting
) -> list[str]:
    budget = policy.max_total_bytes
    candidates = [e for e in entries if e.rule is not None and not e.dropped and not e.protected]
    candidates.sort(key=lambda e: (policy.rules[e.rule or 0].budget_priority, e.time, e.name))
    for entry in candidates:
        if accounting.total <= budget:
            break
        entry.dropped.append(f"over budget {format_size(budget)} (oldest unprotected)")
        entry.frees = accounting.drop(entry.content)
    if accounting.total > budget:
        return [
            f"still {format_size(accounting.total - budget)} over the {format_size(budget)} "
            "budget: everything left is protected"
        ]
    return []


def _local(ts: float, zone: dt.tzinfo | None) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, tz=zone)


def _bucket(word: str, when: dt.datetime) -> str:
    if word == "hourly":
        return when.strftime("%Y-%m-%d %H:00")
    if word == "daily":
        return when.strftime("%Y-%m-%d")
    if word == "weekly":
        year, week, _ = when.isocalendar()
        return f"{year}-W{week:02d}"
    return when.strftime("%Y-%m")
