"""The repair command: rebuild damaged refs from what the store still holds, set the rest aside."""

from __future__ import annotations

import sys

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx


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
    from tqdm import tqdm

    repo = obj.open(create=False)
    total = len(repo.ref_names(selector))
    # Counted in refs: a large store's scan takes minutes on S3.
    with tqdm(total=total, desc="repair", unit="ref", disable=obj.quiet, file=sys.stderr,
              leave=False) as bar:  # fmt: skip
        report = repo.repair_refs(selector, dry_run=dry_run, progress=bar.update)
    if as_json:
        emit_json(report.to_dict())
    else:
        for line in report.summary():
            click.echo(line)
    if report.unfixed:
        raise SystemExit(1)
