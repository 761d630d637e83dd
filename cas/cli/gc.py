"""Garbage collection, space and store maintenance commands: gc, du, stats, leases, unlock,
migrate."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from cas.cli.app import (
    Context,
    cli,
    emit_json,
    human_bytes,
    json_option,
    pass_ctx,
    ref_argument,
    require_refs,
    warn_damaged,
)


def _parsed(parse: Callable[[str], Any], value: str | None) -> Any:
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e


def duration_param(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """Click callback: a duration option (``36h``, ``7d``) in seconds."""
    from cas.units import parse_duration

    seconds: float | None = _parsed(parse_duration, value)
    return seconds


def size_param(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """Click callback: a size option (``150G``) in bytes."""
    from cas.units import parse_size

    nbytes: int | None = _parsed(parse_size, value)
    return nbytes


@cli.command()
@click.option(
    "-n", "--dry-run", is_flag=True, help="Print the plan; delete nothing, write nothing."
)
@click.option(
    "--grace",
    callback=duration_param,
    metavar="DURATION",
    help="Keep unreachable objects younger than this [store setting, 1h].",
)
@click.option(
    "--reflog-window",
    callback=duration_param,
    metavar="DURATION",
    help="Ref history younger than this keeps its checkpoints [store setting, 1h].",
)
@click.option("--list", "list_keys", is_flag=True, help="With --json: include every key to delete.")
@json_option
@pass_ctx
def gc(
    obj: Context,
    dry_run: bool,
    grace: float | None,
    reflog_window: float | None,
    list_keys: bool,
    as_json: bool,
) -> None:
    """Delete chunks and manifests no ref reaches, once older than the grace period.

    Safe while training writes: writers hold leases and refresh what they reuse. A damaged
    ref, manifest or history entry is kept and named (a warning line each, exit status 0); what
    its bytes still name is kept, and while what it reaches cannot be known, GC deletes nothing
    (`cas repair`, `cas rm`).
    """
    repo = obj.open(create=False, readonly=dry_run)  # a dry run writes nothing, not even a lock
    doc = run_gc(repo, grace, reflog_window, dry_run, list_keys, as_json)
    if as_json:
        emit_json(doc)


def run_gc(
    repo: Any,
    grace: float | None,
    window: float | None,
    dry_run: bool,
    list_keys: bool,
    as_json: bool,
    warned: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Plan GC (store settings, overridden by ``grace``/``window``), print it, execute it unless
    ``dry_run``; return the JSON document. Each damaged ref not in ``warned`` gets a warning
    line on stderr (the run goes on around it)."""
    from dataclasses import replace

    settings = repo.gc_settings()
    settings = replace(
        settings,
        grace=settings.grace if grace is None else grace,
        reflog_window=settings.reflog_window if window is None else window,
    )
    plan = repo.plan_gc(settings, lock=not dry_run)
    doc: dict[str, Any] = {"dry_run": dry_run, "plan": plan.to_dict(keys=list_keys)}
    warn_damaged(str(d) for d in plan.damaged if d.ref not in warned)
    if not as_json:
        for line in plan.summary():
            click.echo(line)
    if not dry_run:
        result = plan.execute()
        doc["result"] = {**result.__dict__, "freed_bytes": result.freed_bytes}
        if not as_json:
            spared = f", {result.spared} reused meanwhile and kept" if result.spared else ""
            click.echo(
                f"deleted {result.deleted_chunks} chunks and {result.deleted_manifests} manifests, "
                f"freed {human_bytes(result.freed_bytes)} in {result.seconds:.1f}s{spared}"
            )
    return doc


@cli.command()
@ref_argument("selector", default="")
@click.option("-r", "--refs", "per_ref", is_flag=True, help="One line per ref as well.")
@json_option
@pass_ctx
def du(obj: Context, selector: str, per_ref: bool, as_json: bool) -> None:
    """Space used by SELECTOR (a ref, prefix or glob; default everything).

    logical: bytes a reader gets back; stored: bytes on storage; exclusive: freed if the
    selection were removed (then `cas gc`); shared: stored bytes other refs also need.
    A ref whose record or manifest cannot be read is named on stderr and not counted; a
    SELECTOR that selects no ref is an error.
    """
    repo = obj.open(create=False, readonly=True)
    require_refs(repo, [selector])
    report = repo.disk_usage(selector)
    warn_damaged(f"{d} (not counted)" for d in report.damaged)
    if as_json:
        emit_json(report.to_dict())
        return
    if per_ref:
        click.echo(f"{'logical':>10} {'stored':>10} {'exclusive':>10}  ref")
        for row in report.refs:
            sizes = (row.logical_bytes, row.stored_bytes, row.exclusive_bytes)
            click.echo(" ".join(f"{human_bytes(n):>10}" for n in sizes) + f"  {row.ref}")
    click.echo(
        f"{selector or '(all refs)'}: {len(report.refs)} refs, logical {human_bytes(report.logical_bytes)}, "
        f"stored {human_bytes(report.stored_bytes)}, exclusive {human_bytes(report.exclusive_bytes)}, "
        f"shared {human_bytes(report.shared_bytes)}"
    )
    if report.missing_objects:
        click.echo(
            f"WARNING: {report.missing_objects} objects are missing; run `cas verify`", err=True
        )


@cli.command()
@json_option
@pass_ctx
def stats(obj: Context, as_json: bool) -> None:
    """Chunk, manifest and ref counts, and how much dedup and compression save.

    stored counts what `cas du` and `cas show` count: chunks and manifests (small tensors live
    in manifests), each once; the dedup ratio is logical bytes over those stored bytes.

    A ref whose record or manifest cannot be read is named on stderr and not counted.
    """
    repo = obj.open(create=False, readonly=True)
    s = repo.store_stats()
    warn_damaged(f"{d} (not counted)" for d in s.damaged)
    if as_json:
        emit_json(s.to_dict())
        return
    click.echo(f"refs           {s.refs}")
    click.echo(f"manifests      {s.manifests} ({human_bytes(s.manifest_bytes)})")
    click.echo(
        f"chunks         {s.chunks} ({human_bytes(s.chunk_bytes)}), {s.reachable_chunks} reachable"
    )
    click.echo(f"logical        {human_bytes(s.logical_bytes)} (every ref as a full copy)")
    click.echo(
        f"stored         {human_bytes(s.stored_bytes)} (chunks and manifests refs reach, as "
        f"`cas du`) -> dedup ratio {s.dedup_ratio:.2f}x (logical / stored)"
    )
    click.echo(
        f"unique         {human_bytes(s.unique_bytes)} decoded in reachable chunks -> "
        f"compression ratio {s.compression_ratio:.2f}x"
    )
    click.echo(
        f"unreachable    {human_bytes(s.unreachable_bytes)} (freed by `cas gc` after the grace period)"
    )
    if s.quarantined_objects:
        click.echo(
            f"quarantined    {s.quarantined_objects} objects ({human_bytes(s.quarantined_bytes)}) "
            "found corrupt, moved aside (`cas verify --full --repair-from URL` restores them)"
        )


@cli.command()
@json_option
@pass_ctx
def leases(obj: Context, as_json: bool) -> None:
    """Writer leases (saves in flight) and the maintenance lock."""
    repo = obj.open(create=False, readonly=True)
    now = repo.clock()
    states = repo.writer_leases(now)
    lock = repo.maintenance_lock_holder()
    if as_json:
        rows = [
            {
                "writer": s.lease.writer,
                "host": s.lease.host,
                "pid": s.lease.pid,
                "purpose": s.lease.purpose,
                "started": s.lease.started,
                "expires": s.lease.expires,
                "live": s.live,
            }
            for s in states
        ]
        emit_json(
            {
                "leases": rows,
                "maintenance_lock": (
                    {"holder": lock.description, "expires": lock.expires} if lock else None
                ),
            }
        )
        return
    for state in states:
        left = state.lease.expires - now
        click.echo(
            f"{'live' if state.live else 'expired':<8} {state.lease.writer}  "
            f"{state.lease.purpose}  expires in {left:.0f}s"
        )
    click.echo(
        f"maintenance lock: {lock.description}, expires in {lock.expires - now:.0f}s"
        if lock
        else "maintenance lock: free"
    )


@cli.command()
@click.option("--yes", is_flag=True, help="Do not ask.")
@json_option
@pass_ctx
def unlock(obj: Context, yes: bool, as_json: bool) -> None:
    """Break the maintenance lock of a `cas forget`/`cas gc` that died."""
    if not yes and sys.stdin.isatty():
        click.confirm("Break the maintenance lock (only if no forget/gc is running)?", abort=True)
    repo = obj.open(create=False)
    removed = repo.break_maintenance_lock()
    if as_json:
        emit_json({"removed": removed})
        return
    click.echo("lock removed" if removed else "there was no lock")


@cli.command()
@click.option("-n", "--dry-run", is_flag=True, help="Print what would change; change nothing.")
@json_option
@pass_ctx
def migrate(obj: Context, dry_run: bool, as_json: bool) -> None:
    """Move the store to the format version of this cas, one step per version.

    Safe to rerun: a migration that was interrupted carries on where it stopped.
    """
    from cas.repo.migrate import migrate as run_migration

    repo = obj.open(create=False)
    report = run_migration(repo, dry_run=dry_run)
    if as_json:
        emit_json(report.to_dict())
        return
    if not report.steps:
        click.echo(f"store is at format version {report.from_version}, nothing to do")
        return
    for step, actions in report.steps:
        click.echo(f"version {step.version} -> {step.version + 1}: {step.title}")
        for action in actions:
            click.echo(f"  {action}")
        if not actions:
            click.echo("  (no older layouts found; only the version changes)")
    verb = "would move" if dry_run else "moved"
    click.echo(f"{verb} the store from version {report.from_version} to {report.to_version}")
