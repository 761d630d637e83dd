"""The repair command: rebuild damaged refs from what the store still holds, set the rest aside."""

from __future__ import annotations

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx, progress_bar


@cli.command()
@click.argument("selector", default="", required=False)
@click.option("-n", "--dry-run", is_flag=True, help="Print what would change; change nothing.")
@json_option
@pass_ctx
def repair(obj: Context, selector: str, dry_run: bool, as_json: bool) -> None:
    """Rebuild damaged refs (all, or those SELECTOR picks) from what the store still holds.

    \b
    A ref record that cannot be read is moved under damaged/ (its bytes kept) and the
    ref rebuilt at the checkpoint its bytes still name, or its history segments' newest;
    unreadable history entries are dropped from a record (a copy is kept under damaged/);
    a ref whose manifest is missing moves back to the newest earlier target it had.
    What cannot be rebuilt is named, and the exit status is 1.
    """
    repo = obj.open(create=False)
    total = len(repo.ref_names(selector)) if not obj.quiet else None
    with progress_bar(obj, total, "repair") as update:
        report = repo.repair_refs(selector, dry_run=dry_run, progress=update)
    if as_json:
        emit_json(report.to_dict())
    else:
        for line in report.summary():
            click.echo(line)
    if report.unfixed:
        raise SystemExit(1)
