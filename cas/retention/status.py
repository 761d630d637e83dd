"""The store's status report: usage against the budget, protected refs, runs, pending GC.

``store_status`` answers what a retention manager's operator asks each morning, from what the
other reports already compute: stored bytes and what refs reach (``cas.retention.space``)
against the stored policy's ``max_total_bytes``, how many refs are protected and how many the
stored policy would remove now (``cas.retention.plan``), the oldest and newest checkpoint, each
run's ``latest`` and ``best``, what ``cas gc`` would free now and what waits for the grace period
(``cas.retention.gc``), and the quarantined objects. It changes nothing.

A *checkpoint* here is a ref that is not a pointer, a log or a daily snapshot: names ending in
``latest``, ``best`` or ``history`` and gates (``gates/...``) name checkpoints other refs already
name; the stored policy's daily snapshots (``snapshots/{date}``) are counted apart.
A *run* is the prefix of a ``.../latest`` ref; its ``best`` refs are the ``.../best`` refs under
that prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cas.names import ref_matches
from cas.refs.stores import Stores
from cas.retention.gc import GCSettings, plan_gc
from cas.retention.plan import plan_forget
from cas.retention.policy import RetentionPolicy, protection_of
from cas.retention.space import Accounting, ObjectId, RefContent, readable_contents, store_stats
from cas.units import format_duration, format_size

POINTER_PATTERNS = ("**/latest", "**/best", "**/history", "**/gates/**")
"""Refs that point at checkpoints other refs name, or hold a log: not counted as checkpoints."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint ref: when its manifest was made, and the step and metrics it records."""

    ref: str
    created_at: float
    step: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "ref": self.ref,
            "created_at": self.created_at,
            "step": self.step,
            "metrics": self.metrics,
        }

    def describe(self) -> str:
        """``runs/r1/.../ckpt_step00000003 (step 3, loss=1, 2026-11-26 13:00 UTC)``."""
        parts = [] if self.step is None else [f"step {self.step}"]
        parts.extend(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.metrics.items()
        )
        parts.append(_when(self.created_at))
        return f"{self.ref} ({', '.join(parts)})"


@dataclass(frozen=True)
class RunStatus:
    """A run's ``latest`` and its ``best`` pointers, each as the checkpoint it names."""

    run: str
    latest: CheckpointInfo
    best: tuple[tuple[str, CheckpointInfo], ...]
    """``(best pointer, checkpoint)`` per phase."""
    gates: int
    damaged: tuple[str, ...] = ()
    """The run's refs that cannot be used (record or manifest damaged): retention keeps them
    out of its count and never removes them; ``cas repair`` or ``cas rm`` clears them."""
    retention: str | None = None
    """Why the run's own retention policy fell behind, as its newest checkpoint records it
    (``CheckpointManager``: an error, or damaged refs kept), or None."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "run": self.run,
            "latest": self.latest.to_dict(),
            "best": [{"pointer": p, **c.to_dict()} for p, c in self.best],
            "gates": self.gates,
            "damaged": list(self.damaged),
            "retention": self.retention,
        }


@dataclass(frozen=True)
class StoreStatus:
    """``cas status``: one snapshot of the store, for an operator or a cron job's log."""

    now: float
    stored_bytes: int
    """Everything the store holds: chunks and manifests, reachable or not."""
    referenced_bytes: int
    """What the refs reach (what the budget limits)."""
    budget: int
    """The stored policy's ``max_total_bytes`` (0: none)."""
    has_policy: bool
    refs: int
    protected_refs: int
    """Refs no forget removes: gates, ``best`` pointers, and what the stored policy protects."""
    forget_would_remove: int
    """Refs a plain ``cas forget`` would remove now (0 without a stored policy)."""
    checkpoints: int
    snapshots: int
    """Daily snapshots the stored policy takes (``DailySnapshot``)."""
    newest_snapshot: CheckpointInfo | None
    oldest: CheckpointInfo | None
    newest: CheckpointInfo | None
    runs: tuple[RunStatus, ...]
    gc_collectable_bytes: int
    """What ``cas gc`` would free now."""
    gc_waiting_bytes: int
    """What no ref needs but the grace period or reflog window keeps for now."""
    gc_waiting_until: float | None
    quarantined_objects: int
    quarantined_bytes: int
    damaged_refs: tuple[str, ...] = ()
    damage: tuple[tuple[str, str], ...] = ()
    """``(ref, what is wrong)`` for every damaged ref record, manifest or history entry."""
    gc_held: bool = False
    """Whether ``cas gc`` deletes nothing now, because damage hides what it reaches."""
    gc_withheld_bytes: int = 0

    @property
    def usage_pct(self) -> float | None:
        """``referenced_bytes`` as a percentage of the budget (None without one)."""
        return 100.0 * self.referenced_bytes / self.budget if self.budget else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "now": self.now,
            "stored_bytes": self.stored_bytes,
            "referenced_bytes": self.referenced_bytes,
            "budget": self.budget,
            "usage_pct": None if self.usage_pct is None else round(self.usage_pct, 2),
            "has_policy": self.has_policy,
            "refs": self.refs,
            "protected_refs": self.protected_refs,
            "forget_would_remove": self.forget_would_remove,
            "checkpoints": self.checkpoints,
            "snapshots": self.snapshots,
            "newest_snapshot": self.newest_snapshot.to_dict() if self.newest_snapshot else None,
            "oldest": self.oldest.to_dict() if self.oldest else None,
            "newest": self.newest.to_dict() if self.newest else None,
            "runs": [run.to_dict() for run in self.runs],
            "gc": {
                "collectable_bytes": self.gc_collectable_bytes,
                "waiting_bytes": self.gc_waiting_bytes,
                "waiting_until": self.gc_waiting_until,
                "held": self.gc_held,
                "withheld_bytes": self.gc_withheld_bytes,
            },
            "quarantine": {"objects": self.quarantined_objects, "bytes": self.quarantined_bytes},
            "damaged_refs": list(self.damaged_refs),
            "damage": [{"ref": ref, "problem": problem} for ref, problem in self.damage],
        }

    def describe(self) -> list[str]:
        """Human-readable lines."""
        budget = (
            f" / budget {format_size(self.budget)} ({self.usage_pct:.1f}% used)"
            if self.budget
            else " (no budget)"
        )
        lines = [
            f"storage: {format_size(self.referenced_bytes)} referenced{budget}; "
            f"{format_size(self.stored_bytes)} stored",
            f"refs: {self.refs} total, {self.protected_refs} protected"
            + (
                f", {self.forget_would_remove} `cas forget` would remove now"
                if self.has_policy
                else ", no stored retention policy"
            ),
            f"checkpoints: {self.checkpoints}",
        ]
        if self.oldest is not None and self.newest is not None:
            lines.append(f"  oldest: {self.oldest.describe()}")
            lines.append(f"  newest: {self.newest.describe()}")
        if self.newest_snapshot is not None:
            lines.append(
                f"daily snapshots: {self.snapshots}, newest {self.newest_snapshot.describe()}"
            )
        for run in self.runs:
            lines.append(f"run {run.run or '(top level)'}: latest {run.latest.describe()}")
            lines.extend(f"  best {pointer}: {c.describe()}" for pointer, c in run.best)
            if run.gates:
                lines.append(f"  gates: {run.gates}")
            if run.retention:
                lines.append(f"  retention behind: {run.retention}")
            if run.damaged:
                lines.append(
                    f"  retention keeps {len(run.damaged)} damaged refs out of its count: "
                    + ", ".join(run.damaged)
                )
        gc_line = f"gc: {format_size(self.gc_collectable_bytes)} collectable now"
        if self.gc_waiting_bytes and self.gc_waiting_until is not None:
            left = format_duration(max(0.0, self.gc_waiting_until - self.now))
            gc_line += (
                f", {format_size(self.gc_waiting_bytes)} waiting for the grace period "
                f"(collectable by {_when(self.gc_waiting_until)}, in {left})"
            )
        if self.gc_held:
            gc_line += (
                f"; deletes nothing while damage hides what it reaches "
                f"({format_size(self.gc_withheld_bytes)} withheld)"
            )
        lines.append(gc_line)
        if self.quarantined_objects:
            lines.append(
                f"quarantined: {self.quarantined_objects} objects "
                f"({format_size(self.quarantined_bytes)}); "
                "`cas verify --full --repair-from URL` restores them"
            )
        lines.extend(f"WARNING: damaged ref {ref}: {problem}" for ref, problem in self.damage)
        if self.damage:
            lines.append("`cas repair` sets aside or rebuilds damaged refs; `cas rm` removes one")
        return lines


def is_pointer(name: str) -> bool:
    """Whether ``name`` is a pointer or a log rather than a checkpoint of its own."""
    return any(ref_matches(name, pattern) for pattern in POINTER_PATTERNS)


def store_status(
    stores: Stores,
    policy: RetentionPolicy | None,
    settings: GCSettings,
    *,
    clock: Callable[[], float] | None = None,
    lock: bool = True,
) -> StoreStatus:
    """Build the status report (reads every ref and manifest, lists every object once more
    for the GC plan; deletes nothing). Without ``lock`` nothing is written, not even the
    maintenance lock: for a store opened read-only."""
    gc_plan = plan_gc(stores, settings, clock=clock, lock=lock)
    now = gc_plan.now
    contents, damaged = readable_contents(stores)
    damage = [(d.ref, d.error.splitlines()[0] if d.error else "damaged") for d in damaged]
    unreadable = {d.ref for d in damaged}
    damage += [(d.ref, d.problem) for d in gc_plan.damaged if d.ref not in unreadable]
    union: set[ObjectId] = {o for c in contents for o in c.objects}
    referenced = Accounting(stores.objects.stored_sizes(union), contents).before
    stats = store_stats(stores)
    by_name = {c.name: c for c in contents}
    protected = {c.name for c in contents if protection_of(c.name, policy) is not None}
    would_remove = 0
    if policy is not None:
        forget_plan = plan_forget(stores, policy, now=now)
        would_remove = len(forget_plan.dropped)
        protected.update(
            d.ref
            for d in forget_plan.decisions
            if d.protected and d.reasons != ("no rule selects it",)
        )
    snapshot_rules = [snap.rule() for snap in policy.snapshots] if policy else []
    snapshots = sorted(
        (c for c in contents if any(ref_matches(c.name, r.select) for r in snapshot_rules)),
        key=lambda c: (c.created_at, c.name),
    )
    taken = {c.name for c in snapshots}
    checkpoints = sorted(
        (c for c in contents if not is_pointer(c.name) and c.name not in taken),
        key=lambda c: (c.created_at, c.name),
    )
    return StoreStatus(
        now=now,
        stored_bytes=stats.chunk_bytes + stats.manifest_bytes,
        referenced_bytes=referenced,
        budget=policy.max_total_bytes if policy else 0,
        has_policy=policy is not None,
        refs=len(contents),
        protected_refs=len(protected),
        forget_would_remove=would_remove,
        checkpoints=len(checkpoints),
        snapshots=len(snapshots),
        newest_snapshot=_info(snapshots[-1]) if snapshots else None,
        oldest=_info(checkpoints[0]) if checkpoints else None,
        newest=_info(checkpoints[-1]) if checkpoints else None,
        runs=_runs(by_name, sorted(unreadable)),
        gc_collectable_bytes=gc_plan.freed_bytes,
        gc_waiting_bytes=gc_plan.waiting_bytes,
        gc_waiting_until=gc_plan.waiting_until,
        quarantined_objects=stats.quarantined_objects,
        quarantined_bytes=stats.quarantined_bytes,
        damaged_refs=tuple(d.ref for d in damaged),
        damage=tuple(damage),
        gc_held=gc_plan.held,
        gc_withheld_bytes=gc_plan.withheld_bytes,
    )


def _info(content: RefContent) -> CheckpointInfo:
    step = content.meta.get("step")
    metrics = content.meta.get("metrics")
    return CheckpointInfo(
        content.name,
        content.created_at,
        step if isinstance(step, int) and not isinstance(step, bool) else None,
        dict(metrics) if isinstance(metrics, dict) else {},
    )


def _pointee(pointer: RefContent, by_name: dict[str, RefContent]) -> CheckpointInfo:
    """The checkpoint a pointer names: the ref its last move names (the manager writes it in
    the message) when that ref still names the same manifest, else a checkpoint ref naming the
    same manifest, else the pointer itself."""
    history = pointer.record.history
    named = by_name.get(history[-1].message) if history else None
    if named is not None and named.target == pointer.target:
        return _info(named)
    # A pointer set by `cas cp` or a symlink-style script: the checkpoint naming its manifest.
    same = sorted(n for n, c in by_name.items() if c.target == pointer.target and not is_pointer(n))
    return _info(by_name[same[0]] if same else pointer)


def _runs(by_name: dict[str, RefContent], damaged: list[str]) -> tuple[RunStatus, ...]:
    """A run per ``latest`` ref: ``runs/r1/latest`` makes run ``runs/r1``, a top-level
    ``latest`` (a retention manager's single run) the run ``""``, shown as ``(top level)``.
    Each ``best`` and gate belongs to the run with the longest prefix that holds it."""
    latest = sorted(n for n in by_name if n == "latest" or n.endswith("/latest"))
    prefixes = [name.rpartition("/")[0] for name in latest]

    def owner(name: str) -> str | None:
        holding = [p for p in prefixes if not p or name.startswith(p + "/")]
        return max(holding, key=len) if holding else None

    runs = []
    for name, run in zip(latest, prefixes, strict=True):
        inside = sorted(n for n in by_name if owner(n) == run)
        best = tuple(
            (n, _pointee(by_name[n], by_name)) for n in inside if n == "best" or n.endswith("/best")
        )
        gates = sum(1 for n in inside if ref_matches(n, "**/gates/**"))
        hurt = tuple(n for n in damaged if not run or n.startswith(run + "/"))
        note = _retention_note(by_name[name].meta.get("retention"))
        runs.append(RunStatus(run, _pointee(by_name[name], by_name), best, gates, hurt, note))
    return tuple(runs)


def _retention_note(note: Any) -> str | None:
    """The line for a checkpoint's ``retention`` meta (``cas.training.saves.retention_note``)."""
    if not isinstance(note, dict):
        return None
    step = note.get("after_step")
    if note.get("error"):
        return f"retention did not run after step {step}: {note['error']}"
    damaged = note.get("damaged") or []
    return f"retention after step {step} kept {len(damaged)} damaged refs: " + ", ".join(
        str(d) for d in damaged
    )


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))
