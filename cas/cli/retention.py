"""Retention commands: forget and the stored policy (policy show/set/add/clear/log)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx, warn_damaged
from cas.cli.gc import duration_param, run_gc, size_param

F = TypeVar("F", bound=Callable[..., Any])


_RULE_OPTIONS = [
    click.option("--select", metavar="GLOB", help="Refs the rule governs (glob or prefix) [**]."),
    click.option("--name", "rule_name", metavar="NAME", help="A label for the rule."),
    click.option(
        "--group-by",
        metavar="N|REGEX",
        help="Group by N leading name segments or a regex's first group [parent prefix].",
    ),
    click.option(
        "--time",
        "time_source",
        type=click.Choice(["created", "ref"]),
        help="Age from manifest creation or from the ref's last change [created].",
    ),
    click.option("--keep-last", type=int, help="Keep the newest N refs of each group."),
    click.option(
        "--keep-within",
        callback=duration_param,
        metavar="DURATION",
        help="Keep refs younger than this (36h, 7d).",
    ),
    click.option(
        "--keep-hourly",
        type=int,
        help="Keep the newest ref of each of the last N hours that have one.",
    ),
    click.option("--keep-daily", type=int, help="... of the last N days."),
    click.option("--keep-weekly", type=int, help="... of the last N ISO weeks."),
    click.option("--keep-monthly", type=int, help="... of the last N months."),
    click.option(
        "--keep-best",
        multiple=True,
        metavar="METRIC[:min|max[:N]]",
        help="Protect the N best refs by a metric in meta (repeatable).",
    ),
    click.option(
        "--max-count",
        type=int,
        help="FIFO cap: drop the oldest unprotected refs beyond N per group.",
    ),
    click.option("--no-keep-latest", is_flag=True, help="Do not protect each group's newest ref."),
    click.option(
        "--protect-targets-of",
        multiple=True,
        metavar="GLOB",
        help="Protect refs naming the same checkpoint as refs matching GLOB (best, gates).",
    ),
    click.option(
        "--protect-within",
        callback=duration_param,
        metavar="DURATION",
        help="Protect refs younger than this, even from the budget.",
    ),
    click.option(
        "--protect-days",
        type=int,
        help="Protect the newest ref of each of the last N calendar days (2: today, yesterday).",
    ),
    click.option(
        "--budget-priority", type=int, help="Lower goes first when the budget removes refs [0]."
    ),
    click.option(
        "--eviction-log", metavar="NAME", help="Append each removed ref's metadata to this log."
    ),
]
_POLICY_OPTIONS = [
    click.option(
        "--protect",
        multiple=True,
        metavar="GLOB",
        help="Never remove refs matching GLOB (repeatable).",
    ),
    click.option(
        "--min-age",
        callback=duration_param,
        metavar="DURATION",
        help="Never remove refs younger than this.",
    ),
    click.option(
        "--max-total",
        callback=size_param,
        metavar="SIZE",
        help="Budget on what kept refs reach (150G): remove the oldest unprotected beyond it.",
    ),
    click.option(
        "--timezone",
        metavar="TZ",
        help="Where calendar days begin: UTC, local or an IANA name [UTC].",
    ),
]

_SNAPSHOT_OPTIONS = [
    click.option(
        "--daily-snapshot",
        "snapshot_source",
        metavar="GLOB",
        help="Each forget takes today's weights-only copy of the newest checkpoint GLOB selects.",
    ),
    click.option(
        "--snapshot-into",
        metavar="TEMPLATE",
        default="snapshots/{date}",
        show_default=True,
        help="The snapshot's ref name; {date} is YYYY-MM-DD in the policy's timezone.",
    ),
    click.option(
        "--snapshot-only",
        multiple=True,
        metavar="PATTERN",
        help="Entries the snapshot keeps (repeatable) [model.*].",
    ),
    click.option(
        "--snapshot-keep",
        type=int,
        default=7,
        show_default=True,
        help="Keep the last N snapshots (0: all).",
    ),
    click.option(
        "--snapshot-protect-days",
        type=int,
        default=0,
        help="Protect the newest snapshot of each of the last N days, even from the budget.",
    ),
]


def _snapshot_from(options: dict[str, Any]) -> Any:
    """A DailySnapshot from the snapshot flags, or None without --daily-snapshot."""
    from cas.retention.policy import DailySnapshot

    source = options.pop("snapshot_source")
    into = options.pop("snapshot_into")
    only = tuple(options.pop("snapshot_only")) or ("model.*",)
    keep = options.pop("snapshot_keep")
    protect_days = options.pop("snapshot_protect_days")
    if source is None:
        return None
    try:
        return DailySnapshot(source, into, only, keep, protect_days)
    except ValueError as e:
        raise click.UsageError(str(e)) from e


def _apply(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    def decorate(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def _rule_from(options: dict[str, Any]) -> Any:
    """A Rule from the rule flags, or None when no rule flag was given."""
    from cas.retention.policy import rule_from_options

    given = {
        "name": options.pop("rule_name"),
        "group_by": options.pop("group_by"),
        "time": options.pop("time_source"),
        "keep_latest": False if options.pop("no_keep_latest") else None,
        **{
            k: options.pop(k)
            for k in (
                "keep_last",
                "keep_within",
                "keep_hourly",
                "keep_daily",
                "keep_weekly",
                "keep_monthly",
                "keep_best",
                "max_count",
                "protect_targets_of",
                "protect_within",
                "protect_days",
                "budget_priority",
                "eviction_log",
            )
        },
    }
    select = options.pop("select")
    if isinstance(given["group_by"], str) and given["group_by"].isdigit():
        given["group_by"] = int(given["group_by"])
    if select is None and all(v in (None, (), "") for v in given.values()):
        return None
    try:
        return rule_from_options(select or "**", **given)
    except ValueError as e:
        raise click.UsageError(str(e)) from e


def _policy_changes(options: dict[str, Any]) -> dict[str, Any]:
    return {
        "protect": tuple(options.pop("protect")) or None,
        "min_age": options.pop("min_age"),
        "max_total_bytes": options.pop("max_total"),
        "timezone": options.pop("timezone"),
    }


def _policy_from_flags(repo: Any, options: dict[str, Any]) -> Any:
    from cas.retention.policy import RetentionPolicy, policy_with

    rule = _rule_from(options)
    changes = _policy_changes(options)
    stored = repo.retention_policy()
    if rule is None and all(v is None for v in changes.values()):
        if stored is None:
            raise click.UsageError(
                "no retention policy: pass rule flags (e.g. --select 'runs/**' --keep-last 3) "
                "or store one with `cas policy set`"
            )
        return stored
    base = RetentionPolicy(rules=(rule,)) if rule else (stored or RetentionPolicy())
    try:
        return policy_with(base, **changes)
    except ValueError as e:
        raise click.UsageError(str(e)) from e


@cli.command()
@_apply(_RULE_OPTIONS + _POLICY_OPTIONS)
@click.option("-n", "--dry-run", is_flag=True, help="Print the plan; change nothing.")
@click.option("--prune", is_flag=True, help="Run `cas gc` afterwards.")
@click.option(
    "--grace", callback=duration_param, metavar="DURATION", help="With --prune: GC grace period."
)
@click.option(
    "--reflog-window", callback=duration_param, metavar="DURATION", help="With --prune: GC window."
)
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also list the refs kept, and why (--dry-run always does).",
)
@json_option
@pass_ctx
def forget(
    obj: Context,
    /,
    dry_run: bool,
    prune: bool,
    grace: float | None,
    reflog_window: float | None,
    verbose: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Remove refs a retention policy does not keep (flags, else the policy stored in the store).

    \b
    Examples:
      cas forget --select 'cobre/policy/ckpt_*' --keep-last 3 --protect-targets-of cobre/policy/latest
      cas forget --select 'runs/*/phase*/ckpt_*' --max-count 20 --protect-targets-of 'runs/*/gates/*'
      cas policy set ... && cas forget --prune        (what a cron job runs)

    A stored policy's daily snapshots (`cas policy add --daily-snapshot GLOB`) are taken first:
    today's weights-only copy of the newest checkpoint GLOB selects, if it is missing.

    A ref whose record or manifest cannot be read is kept, counted by no rule, and named
    (a warning line each); the others are pruned to the policy and the exit status is 0.
    """
    repo = obj.open(create=False)
    policy = _policy_from_flags(repo, options)
    snapshots = repo.take_snapshots(policy, dry_run=dry_run)
    plan = repo.plan_forget(policy)
    out: dict[str, Any] = {
        "dry_run": dry_run,
        "snapshots": [s.to_dict() for s in snapshots],
        "plan": plan.to_dict(),
    }
    if not as_json:
        for taken in snapshots:
            click.echo(f"snapshot {taken.ref}: {taken.note}")
        for line in plan.summary(show_kept=verbose or dry_run):
            click.echo(line)
    warn_damaged(str(d) for d in plan.damaged)
    if not dry_run:
        result = plan.execute()
        out["result"] = {
            "removed": list(result.removed),
            "skipped": [list(s) for s in result.skipped],
            "logged": result.logged,
        }
        if not as_json:
            click.echo(
                f"removed {len(result.removed)} refs"
                + (f", {result.logged} logged" if result.logged else "")
            )
            for ref, why in result.skipped:
                click.echo(f"skipped {ref}: {why}")
        if prune:
            warned = frozenset(d.ref for d in plan.damaged)
            out["gc"] = run_gc(repo, grace, reflog_window, False, False, as_json, warned)
    if as_json:
        emit_json(out)


@cli.group()
def policy() -> None:
    """Show or change the retention policy and GC settings stored in the store."""


@policy.command("show")
@json_option
@pass_ctx
def policy_show(obj: Context, as_json: bool) -> None:
    """The stored policy and GC settings."""
    from cas.retention.policy import RetentionPolicy
    from cas.units import format_duration

    repo = obj.open(create=False, readonly=True)
    stored = repo.retention_policy()
    settings = repo.gc_settings()
    if as_json:
        emit_json({"retention": stored.to_dict() if stored else None, "gc": settings.to_config()})
        return
    for line in (stored or RetentionPolicy()).describe():
        click.echo(line)
    click.echo(
        f"gc: grace {format_duration(settings.grace)}, reflog window {format_duration(settings.reflog_window)}"
    )


@policy.command("set")
@_apply(_RULE_OPTIONS + _POLICY_OPTIONS + _SNAPSHOT_OPTIONS)
@click.option(
    "--file",
    "policy_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A whole policy as JSON (see `cas policy show --json`).",
)
@click.option(
    "--grace", callback=duration_param, metavar="DURATION", help="Default GC grace period."
)
@click.option(
    "--reflog-window", callback=duration_param, metavar="DURATION", help="Default GC reflog window."
)
@json_option
@pass_ctx
def policy_set(
    obj: Context,
    /,
    policy_file: Path | None,
    grace: float | None,
    reflog_window: float | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Replace the stored policy with one rule (flags) or a JSON file; set GC defaults.

    With --daily-snapshot the stored daily snapshots are replaced by that one.
    """
    _store_policy(obj, options, policy_file, grace, reflog_window, append=False, as_json=as_json)


@policy.command("add")
@_apply(_RULE_OPTIONS + _POLICY_OPTIONS + _SNAPSHOT_OPTIONS)
@json_option
@pass_ctx
def policy_add(obj: Context, /, as_json: bool, **options: Any) -> None:
    """Append one rule (flags) or one daily snapshot (--daily-snapshot) to the stored policy;
    earlier rules win for refs both select (daily snapshots' own rules come first)."""
    _store_policy(obj, options, None, None, None, append=True, as_json=as_json)


def _store_policy(
    obj: Context,
    options: dict[str, Any],
    policy_file: Path | None,
    grace: float | None,
    window: float | None,
    *,
    append: bool,
    as_json: bool,
) -> None:
    from dataclasses import replace

    from cas.errors import FormatError
    from cas.retention.policy import RetentionPolicy, policy_with

    repo = obj.open(create=False)
    snapshot = _snapshot_from(options)
    rule = _rule_from(options)
    changes = _policy_changes(options)
    stored = repo.retention_policy() or RetentionPolicy()
    if policy_file is not None:
        try:
            new = RetentionPolicy.from_dict(json.loads(policy_file.read_text()))
        except ValueError as e:
            raise FormatError(f"{policy_file}: {e}") from e
    elif append:
        new = replace(stored, rules=(*stored.rules, *((rule,) if rule else ())))
    else:
        new = RetentionPolicy(rules=(rule,) if rule else ()) if rule else stored
    if snapshot is not None:
        new = replace(new, snapshots=(*(new.snapshots if append else ()), snapshot))
    try:
        new = policy_with(new, **changes)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    repo.store_retention_policy(new)
    if grace is not None or window is not None:
        settings = repo.gc_settings()
        repo.store_gc_settings(
            replace(
                settings,
                grace=settings.grace if grace is None else grace,
                reflog_window=settings.reflog_window if window is None else window,
            )
        )
    if as_json:
        emit_json({"retention": new.to_dict(), "gc": repo.gc_settings().to_config()})
        return
    for line in new.describe():
        click.echo(line)


@policy.command("clear")
@json_option
@pass_ctx
def policy_clear(obj: Context, as_json: bool) -> None:
    """Remove the stored policy (a plain `cas forget` then refuses to run)."""
    repo = obj.open(create=False)
    had = repo.retention_policy() is not None
    repo.store_retention_policy(None)
    if as_json:
        emit_json({"removed": had})
        return
    click.echo("retention policy removed" if had else "there was no retention policy")


@policy.command("log")
@click.argument("name", required=False)
@json_option
@pass_ctx
def policy_log(obj: Context, name: str | None, as_json: bool) -> None:
    """Records of an eviction log (without NAME: the logs there are)."""
    repo = obj.open(create=False, readonly=True)
    if name is None:
        names = repo.eviction_logs()
        if as_json:
            emit_json(names)
        for log_name in [] if as_json else names:
            click.echo(log_name)
        return
    records = repo.eviction_log(name)
    if as_json:
        emit_json(records)
        return
    for r in records:
        meta = json.dumps(r.get("meta", {}), sort_keys=True)
        click.echo(
            f"{r.get('ref')}  {str(r.get('manifest', ''))[:12]}  {r.get('reason', '')}  {meta}"
        )
