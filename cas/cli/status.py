"""The status command: the retention manager's report on the store."""

from __future__ import annotations

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx, warn_damaged


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
    """
    repo = obj.open(create=False)
    report = repo.status()
    warn_damaged(f"{ref}: {problem}" for ref, problem in report.damage)
    if as_json:
        emit_json(report.to_dict())
        return
    for line in report.describe():
        click.echo(line)
