"""The status command: the retention manager's report on the store, and on its remote tier."""

from __future__ import annotations

from typing import Any

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx, warn_damaged
from cas.errors import CASError
from cas.repo.repository import Repository
from cas.sync.drain import TIERS_SECTION, TierLag
from cas.units import format_duration, format_size


@cli.command()
@json_option
@pass_ctx
def status(obj: Context, as_json: bool) -> None:
    """Usage against the budget, protected refs, runs, pending GC, quarantine and damage.

    \b
    Reports, without changing anything:
      storage      bytes the refs reach against the stored policy's --max-total budget,
                   and everything stored (unreachable objects included)
      refs         how many, how many protected (gates, best pointers, what the policy
                   protects) and how many a plain `cas forget` would remove now
      checkpoints  how many, the oldest and the newest (pointers and logs not counted)
      runs         each run's latest and best checkpoint, and its gates
      gc           what `cas gc` frees now, and what waits for the grace period until when
      quarantine   objects found corrupt and moved aside
      damage       refs whose record, manifest or history cannot be read (also one
                   warning line each on stderr; the exit status stays 0)
      remote tier  where a training run's saves drain to (CheckpointManager(remote=...)),
                   and the saves and bytes not yet there, and since when
    """
    repo = obj.open(create=False)
    report = repo.status()
    warn_damaged(f"{ref}: {problem}" for ref, problem in report.damage)
    tier = remote_tier(repo)
    if as_json:
        emit_json({**report.to_dict(), **({"remote_tier": tier} if tier else {})})
        return
    for line in report.describe():
        click.echo(line)
    if tier:
        click.echo(describe_tier(tier))


def remote_tier(repo: Repository) -> dict[str, Any] | None:
    """The remote tier's lag behind ``repo``, as plain data; None if the store drains nowhere."""
    section = repo.config.extra.get(TIERS_SECTION)
    if not isinstance(section, dict) or not isinstance(section.get("remote"), str):
        return None
    url: str = section["remote"]
    globs = [g for g in section.get("checkpoints", []) if isinstance(g, str)]
    from cas.repo.opening import open as open_store

    lag = TierLag()
    try:
        remote = open_store(url, create=False)
        for selector in globs:
            one = repo.tier_lag(remote, selector)
            oldest = min((t for t in (lag.oldest, one.oldest) if t is not None), default=None)
            lag = TierLag(lag.saves + one.saves, lag.bytes + one.bytes, oldest)
    except CASError as e:
        lag = TierLag(error=f"{type(e).__name__}: {e}")
    return {"remote": url, "checkpoints": globs, **lag.as_dict(repo.clock())}


def describe_tier(tier: dict[str, Any]) -> str:
    """One line: ``remote tier  s3://b/p: 2 saves (12.0 MiB) not yet there, the oldest 35s ago``."""
    where = f"remote tier  {tier['remote']}"
    if tier["error"]:
        return f"{where}: unreadable ({tier['error']})"
    if not tier["saves"]:
        return f"{where}: up to date"
    return (
        f"{where}: {tier['saves']} saves ({format_size(tier['bytes'])}) not yet there, "
        f"the oldest {format_duration(tier['oldest_age_seconds'])} ago"
    )
