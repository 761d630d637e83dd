"""What ``cas ui`` shows, as plain data: the runs, one run, a checkpoint, storage, retention, pools.

Every function here reads a ``Repository`` and returns JSON-able dicts; ``cas.ui.pages`` turns
them into HTML and the server answers either, so the page and its JSON never disagree. Nothing is
written. Listings are paginated so a store of thousands of checkpoints answers quickly: a page of
runs reads one ref record and one manifest per run shown, a run reads its own refs and history.

A *run* is the prefix of a ``.../latest`` or ``.../history`` ref (``runs/<id>`` with the
manager's default layout); the refs under it are its checkpoints, pointers (``latest``, ``best``),
gates (``.../gates/...``), its history, and opponent pools (``.../opponent_pool/...``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cas.errors import CASError, NotFound
from cas.ui.snapshots import Snapshots

if TYPE_CHECKING:
    from cas.repo.repository import Repository

RUNS_PER_PAGE = 50
CHECKPOINTS_PER_PAGE = 100
TENSORS_PER_PAGE = 200
PLAN_ROWS_PER_PAGE = 500
MAX_CHART_POINTS = 2000
"""A loss curve of more records is thinned to about this many points per series."""
MAX_SERIES = 4
POOL_MARK = "/opponent_pool"
POOL_ENTRY = re.compile(r"/pool_v\d+_step\d+\Z")
RUN_ENDINGS = ("/latest", "/history")


@dataclass(frozen=True)
class Page:
    """One page of a listing: which, of how many, and the slice it covers."""

    number: int
    size: int
    total: int

    @classmethod
    def of(cls, requested: int, size: int, total: int) -> Page:
        """Page ``requested`` (1-based), clamped to the pages there are."""
        pages = max(1, math.ceil(total / size))
        return cls(min(max(1, requested), pages), size, total)

    @property
    def pages(self) -> int:
        """How many pages the listing has."""
        return max(1, math.ceil(self.total / self.size))

    def take(self, items: Sequence[Any]) -> Sequence[Any]:
        """This page's items."""
        start = (self.number - 1) * self.size
        return items[start : start + self.size]

    def to_dict(self) -> dict[str, int]:
        """Plain data for JSON."""
        return {
            "page": self.number,
            "pages": self.pages,
            "per_page": self.size,
            "total": self.total,
        }


def find_runs(names: Iterable[str]) -> list[str]:
    """Run prefixes, sorted: the parents of ``latest`` and ``history`` refs, outermost only (a
    per-phase ``latest`` belongs to the run above it when that run has its own)."""
    candidates = {n.rsplit("/", 1)[0] for n in names if n.endswith(RUN_ENDINGS) and "/" in n}
    runs: list[str] = []
    for run in sorted(candidates):
        if not any(run.startswith(f"{outer}/") for outer in runs):
            runs.append(run)
    return runs


def group_by_run(names: Iterable[str], runs: Iterable[str]) -> dict[str, list[str]]:
    """Each run's ref names (a name outside every run is left out)."""
    grouped: dict[str, list[str]] = {run: [] for run in runs}
    for name in names:
        run = run_of(name, grouped)
        if run is not None:
            grouped[run].append(name)
    return grouped


def run_of(name: str, runs: dict[str, Any] | set[str]) -> str | None:
    """The run ``name`` lies under, found by walking its prefixes (no scan over every run)."""
    parts = name.split("/")
    for cut in range(1, len(parts)):
        prefix = "/".join(parts[:cut])
        if prefix in runs:
            return prefix
    return None


def kind_of(name: str) -> str:
    """``latest``, ``best``, ``history``, ``gate``, ``pool`` or ``checkpoint``."""
    if POOL_MARK in name:
        return "pool"
    if "/gates/" in name:
        return "gate"
    for pointer in ("latest", "best", "history"):
        if name == pointer or name.endswith(f"/{pointer}"):
            return pointer
    return "checkpoint"


def _meta_summary(repo: Repository, ref: str, target: str | None = None) -> dict[str, Any]:
    """Step, status, metrics and time of the checkpoint ``ref`` names (``target``: its manifest,
    when the caller read the record already); ``error`` if unreadable."""
    try:
        digest = target or repo.resolve(ref)
        manifest = repo.manifest(digest)
    except CASError as e:
        return {"ref": ref, "error": str(e)}
    meta = manifest.meta
    return {
        "ref": ref,
        "manifest": digest,
        "step": meta.get("step"),
        "phase": meta.get("phase"),
        "status": meta.get("status"),
        "trigger": meta.get("trigger"),
        "metrics": meta.get("metrics") if isinstance(meta.get("metrics"), dict) else {},
        "created_at": manifest.created_at,
    }


NAMES_MAX_AGE = 5.0
"""Seconds the list of ref names is served before it is listed again (a new run shows up
within this, and one refresh)."""

Names = tuple[list[str], list[str], dict[str, list[str]]]


def _names(repo: Repository, snapshots: Snapshots) -> Names:
    """Every ref name, the runs among them and each run's names, listed at most every
    ``NAMES_MAX_AGE`` seconds."""

    def listing() -> Names:
        names = [str(n) for n in repo.ref_names()]
        runs = find_runs(names)
        return names, runs, group_by_run(names, runs)

    value: Names = snapshots.get("names", listing, max_age=NAMES_MAX_AGE).value
    return value


TIERS_SECTION = "tiers"
"""The store config section where a manager with ``remote=`` notes its remote tier."""
REMOTES_SECTION = "remotes"
"""The store config section naming its remotes (``cas remote add``): ``{name: {url, endpoint_url}}``."""


def remote_tiers(repo: Repository, snapshots: Snapshots) -> dict[str, dict[str, Any]]:
    """Each remote the store names: where its runs' ``latest`` pointers stand (a snapshot per
    remote, refreshed as the others are), or why it could not be read."""
    section = dict(repo.config.extra.get(REMOTES_SECTION) or {})
    drained = repo.config.extra.get(TIERS_SECTION)  # the manager's remote tier (remote=)
    known = {t.get("url") for t in section.values() if isinstance(t, dict)}
    remote = drained.get("remote") if isinstance(drained, dict) else None
    if isinstance(remote, str) and remote not in known:
        section.setdefault("tier", {"url": remote})
    out = {}
    for name, table in sorted(section.items()):
        if not isinstance(table, dict) or not isinstance(table.get("url"), str):
            continue
        snapshot = snapshots.get(f"remote:{name}", functools.partial(_remote_latest, table))
        out[name] = {"url": table["url"], **snapshot.value, "as_of": snapshot.computed_at}
    return out


def _remote_latest(table: dict[str, Any]) -> dict[str, Any]:
    """The targets of a remote's ``.../latest`` refs, read through a read-only handle."""
    from cas.repo.opening import open as open_store

    options = {"endpoint_url": table["endpoint_url"]} if table.get("endpoint_url") else {}
    try:
        remote = open_store(table["url"], create=False, readonly=True, **options)
    except CASError as e:
        return {"error": str(e), "latest": {}}
    try:
        listing = remote.list_refs("**/latest")
        return {"latest": {str(r.name): str(r.target) for r in listing.records}}
    except CASError as e:
        return {"error": str(e), "latest": {}}
    finally:
        remote.close()


def tier_state(local_target: str | None, remote_target: str | None) -> str:
    """``same`` (the remote's latest is the local one), ``behind`` or ``absent``."""
    if remote_target is None:
        return "absent"
    return "same" if remote_target == local_target else "behind"


def runs_index(repo: Repository, snapshots: Snapshots, page: int = 1) -> dict[str, Any]:
    """Every run, a page at a time: its latest checkpoint, status and checkpoint count, and
    where each remote tier's ``latest`` of it stands."""
    names, runs, grouped = _names(repo, snapshots)
    tiers = remote_tiers(repo, snapshots)
    at = Page.of(page, RUNS_PER_PAGE, len(runs))
    rows = []
    for run in at.take(runs):
        kinds = [kind_of(n) for n in grouped[run]]
        latest = f"{run}/latest"
        summary = _meta_summary(repo, latest) if latest in grouped[run] else {}
        rows.append(
            {
                "run": run,
                "checkpoints": kinds.count("checkpoint"),
                "gates": kinds.count("gate"),
                "has_history": f"{run}/history" in grouped[run],
                "status": run_state(summary),
                "latest": summary or None,
                "tiers": {
                    remote: tier_state(summary.get("manifest"), tier["latest"].get(latest))
                    for remote, tier in tiers.items()
                },
            }
        )
    remotes = {name: {k: v for k, v in t.items() if k != "latest"} for name, t in tiers.items()}
    return {"refs": len(names), "runs": rows, "remotes": remotes, **at.to_dict()}


def run_state(latest: dict[str, Any]) -> str:
    """``completed`` (a final save), ``interrupted`` (a signal's save), ``running`` (a periodic
    save is the newest), ``damaged`` (unreadable) or ``unknown`` (no manager metadata)."""
    if not latest:
        return "unknown"
    if "error" in latest:
        return "damaged"
    status, trigger = latest.get("status"), latest.get("trigger")
    if status == "completed" or trigger == "final":
        return "completed"
    if trigger in ("signal", "sigterm", "preempt") or status == "interrupted":
        return "interrupted"
    return "running" if status or trigger else "unknown"


def run_detail(repo: Repository, run: str, page: int = 1) -> dict[str, Any]:
    """One run: its history as metric series with save/resume events, and its checkpoints
    (a page at a time) with what points at each: latest, best, gates, pool versions."""
    listing = repo.list_refs(f"{run}/")
    if not listing.records and not listing.damaged:
        raise NotFound(f"no run {run!r} (no refs under {run}/)")
    targets = {str(r.name): str(r.target) for r in listing.records}
    marks: dict[str, list[str]] = {}
    for name, target in targets.items():
        kind = kind_of(name)
        if kind in ("latest", "best", "gate", "pool"):
            marks.setdefault(target, []).append(f"{kind}:{name.removeprefix(run + '/')}")
    history = _history(repo, f"{run}/history") if f"{run}/history" in targets else []
    steps = _save_steps(history)
    checkpoints = sorted(
        (n for n in targets if kind_of(n) == "checkpoint"),
        key=lambda n: (steps.get(n, math.inf), n),
    )
    at = Page.of(page, CHECKPOINTS_PER_PAGE, len(checkpoints))
    rows = []
    for name in at.take(checkpoints):
        row = _meta_summary(repo, name, targets[name])
        row["marks"] = marks.get(targets[name], [])
        rows.append(row)
    latest_ref = f"{run}/latest"
    latest = _meta_summary(repo, latest_ref, targets[latest_ref]) if latest_ref in targets else {}
    return {
        "run": run,
        "status": run_state(latest),
        "latest": latest or None,
        "series": metric_series(history),
        "events": _events(history, targets, marks),
        "checkpoints": rows,
        "pointers": [
            {"ref": n, "kind": kind_of(n), "target": t}
            for n, t in sorted(targets.items())
            if kind_of(n) in ("latest", "best", "gate")
        ],
        "pools": sorted({n.split(POOL_MARK)[0] + POOL_MARK for n in targets if POOL_MARK in n}),
        "damaged": [d.to_dict() for d in listing.damaged],
        **at.to_dict(),
    }


def _history(repo: Repository, ref: str) -> list[dict[str, Any]]:
    from cas.training.history import TrainingHistory

    try:
        return TrainingHistory(repo, ref).read()
    except CASError:
        return []


def _save_steps(history: Sequence[dict[str, Any]]) -> dict[str, int]:
    return {
        str(r["ref"]): int(r["step"])
        for r in history
        if r.get("event") == "save" and isinstance(r.get("ref"), str)
    }


def metric_series(history: Sequence[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """``{"loss": [[step, value], ...], ...}`` from the history's numeric values (``metrics.x``
    of save events too), at most ``MAX_SERIES`` series, thinned to ``MAX_CHART_POINTS``."""
    series: dict[str, list[list[float]]] = {}
    for record in history:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        for key, value in _numbers(record):
            if key != "step":
                series.setdefault(key, []).append([step, value])
    for key in [k for k in series if k.startswith("metrics.")]:
        if key.removeprefix("metrics.") in series:  # logged each step and again with a save
            del series[key]
    ranked = sorted(series, key=lambda k: (not k.endswith("loss"), -len(series[k]), k))
    return {key: _thin(sorted(series[key])) for key in ranked[:MAX_SERIES]}


def _numbers(record: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    for key, value in record.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield f"{prefix}{key}", float(value)
        elif isinstance(value, dict) and not prefix:
            yield from _numbers(value, f"{key}.")


def _thin(points: list[list[float]]) -> list[list[float]]:
    if len(points) <= MAX_CHART_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_CHART_POINTS)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def _events(
    history: Sequence[dict[str, Any]], targets: dict[str, str], marks: dict[str, list[str]]
) -> list[dict[str, Any]]:
    """Save, resume, warm-start and pivot events on the step axis, each save with its marks."""
    out = []
    for record in history:
        event, step = record.get("event"), record.get("step")
        if not isinstance(event, str) or not isinstance(step, int):
            continue
        ref = record.get("ref") if isinstance(record.get("ref"), str) else None
        row: dict[str, Any] = {"event": event, "step": step, "ref": ref}
        if event == "save" and ref is not None:
            row["exists"] = ref in targets
            row["marks"] = marks.get(targets.get(ref, ""), [])
        out.append(row)
    return out


def checkpoint_detail(
    repo: Repository, ref: str, snapshots: Snapshots, page: int = 1
) -> dict[str, Any]:
    """One checkpoint: tensors (a page at a time), metadata, lineage and its bytes (exclusive
    bytes from the store's usage snapshot)."""
    shown = repo.show(ref)
    tensors = shown.pop("tensors")
    at = Page.of(page, TENSORS_PER_PAGE, len(tensors))
    index = snapshots.get("index", repo.usage_index)
    run = run_of(ref, set(find_runs(index.value.by_name)))
    shown["tensors"] = list(at.take(tensors))
    shown["tensor_page"] = at.to_dict()
    shown["exclusive_bytes"] = index.value.exclusive(ref)
    shown["as_of"] = index.computed_at
    shown["lineage"] = _lineage(repo, ref, shown, run)
    shown["run"] = run
    return shown


def _lineage(repo: Repository, ref: str, shown: dict[str, Any], run: str | None) -> dict[str, Any]:
    """Parent, delta bases, and the refs of the same run that name the same manifest or the
    parent (copies: gates, best, pool versions; no chunk of theirs is stored twice)."""
    records = repo.list_refs(f"{run}/").records if run else ()
    same = [str(r.name) for r in records if str(r.target) == shown["manifest"] and r.name != ref]
    parent = shown.get("parent")
    parent_refs = [str(r.name) for r in records if parent and str(r.target) == parent]
    manifest = repo.manifest(ref)
    bases = sorted({d for t in manifest.tensors for d in t.base_digests()})
    shared_with_parent = None
    if parent:
        try:
            mine = {c.digest: c.size for c in manifest.chunk_refs()}
            theirs = {c.digest for c in repo.manifest(parent).chunk_refs()}
            shared_with_parent = sum(size for d, size in mine.items() if d in theirs)
        except CASError:
            shared_with_parent = None
    return {
        "parent": parent,
        "parent_refs": parent_refs,
        "copies": same,
        "delta_bases": len(bases),
        "shared_with_parent_bytes": shared_with_parent,
    }


def storage(repo: Repository, snapshots: Snapshots) -> dict[str, Any]:
    """Usage against the budget, dedup savings, each run's own bytes, what GC frees now: one
    snapshot of the store (``as_of`` says when it was computed)."""
    snapshot = snapshots.get("storage", lambda: _storage(repo, snapshots))
    return {**snapshot.value, "as_of": snapshot.computed_at}


def _storage(repo: Repository, snapshots: Snapshots) -> dict[str, Any]:
    index = snapshots.get("index", repo.usage_index).value
    stats = repo.store_stats()
    status = _status_or_error(repo)
    runs = set(find_runs(index.by_name))
    per_run = index.groups(lambda name: run_of(name, runs))
    out: dict[str, Any] = {
        "referenced_bytes": index.referenced_bytes,
        "logical_bytes": stats.logical_bytes,
        "unique_bytes": stats.unique_bytes,
        # Chunks and manifests refs reach, as `cas stats`, `du` and `show` count them.
        "reachable_stored_bytes": stats.stored_bytes,
        "dedup_ratio": stats.dedup_ratio,
        "saved_bytes": max(0, stats.logical_bytes - stats.stored_bytes),
        "runs": [u.to_dict() for u in per_run],
        "damaged_refs": [d.ref for d in index.damaged],
        "quarantine": {"objects": stats.quarantined_objects, "bytes": stats.quarantined_bytes},
    }
    if isinstance(status, str):  # e.g. GC's plan refuses while a ref is damaged
        stored = stats.manifest_bytes + stats.chunk_bytes
        return {**out, "stored_bytes": stored, "budget": 0, "usage_pct": None, "gc": None,
                "error": status}  # fmt: skip
    return {
        **out,
        "stored_bytes": status.stored_bytes,
        "budget": status.budget,
        "usage_pct": status.usage_pct,
        "gc": {
            "collectable_bytes": status.gc_collectable_bytes,
            "waiting_bytes": status.gc_waiting_bytes,
            "waiting_until": status.gc_waiting_until,
        },
    }


def _status_or_error(repo: Repository) -> Any:
    """``cas status``'s report without taking the lock, or why it cannot be made."""
    try:
        return repo.status(lock=False)
    except CASError as e:
        return str(e)


def retention(repo: Repository, snapshots: Snapshots, page: int = 1) -> dict[str, Any]:
    """The stored policy's plan as a timeline: each ref kept, protected (by which rule) or to
    be forgotten. Nothing is deleted; ``cas forget --dry-run`` prints the same plan."""
    snapshot = snapshots.get("plan", lambda: _plan(repo))
    if snapshot.value is None:
        return {"policy": None, "decisions": [], **Page.of(1, PLAN_ROWS_PER_PAGE, 0).to_dict()}
    policy, plain, rows = snapshot.value
    at = Page.of(page, PLAN_ROWS_PER_PAGE, len(rows))
    return {
        "as_of": snapshot.computed_at,
        "policy": policy,
        "now": plain["now"],
        "bytes_before": plain["bytes_before"],
        "bytes_after": plain["bytes_after"],
        "freed_bytes": plain["freed_bytes"],
        "budget": plain["budget"],
        "warnings": plain["warnings"],
        "kept": len(plain["keep"]),
        "forgotten": len(plain["drop"]),
        "decisions": list(at.take(rows)),
        **at.to_dict(),
    }


def _plan(
    repo: Repository,
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]] | None:
    """The stored policy, its plan as plain data, and the plan's rows in time order (None
    without a stored policy)."""
    policy = repo.retention_policy()
    if policy is None:
        return None
    plain = repo.plan_forget(policy).to_dict()
    rows = sorted(
        [{**d, "keep": True} for d in plain["keep"]]
        + [{**d, "keep": False} for d in plain["drop"]],
        key=lambda d: (d.get("time") or 0, d["ref"]),
    )
    return policy.to_dict(), plain, rows


def warm(repo: Repository, snapshots: Snapshots) -> None:
    """Compute every whole-store snapshot once, one after the other (a server's first act)."""
    _names(repo, snapshots)
    for name, compute in (
        ("index", repo.usage_index),
        ("storage", lambda: _storage(repo, snapshots)),
        ("plan", lambda: _plan(repo)),
    ):
        try:
            snapshots.get(name, compute)
        except CASError:
            continue  # the page that needs it computes it again and says what is wrong


def pools(repo: Repository, snapshots: Snapshots) -> dict[str, Any]:
    """Every opponent pool: its versions with ratings and anchors, and its eviction log."""
    from cas.training.pool import OpponentPool

    names, _, _ = _names(repo, snapshots)
    prefixes = sorted({n.split(POOL_MARK)[0] + POOL_MARK for n in names if POOL_MARK in n})
    out = []
    for prefix in prefixes:
        pool = OpponentPool(repo, prefix)
        try:
            entries = [
                {**e.meta(), "ref": e.ref, "rating": e.conservative_rating} for e in pool.entries()
            ]
            evictions = pool.evictions()
            error = None
        except CASError as e:
            entries, evictions, error = [], [], str(e)
        out.append({"prefix": prefix, "entries": entries, "evictions": evictions, "error": error})
    return {"pools": out}
