"""Removing and mending refs: ``rm`` (any ref, readable or not) and ``repair`` (rebuild damaged
refs from what the store still holds, set the rest aside)."""

from __future__ import annotations

import sys

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx, ref_argument


@cli.command()
@ref_argument("refs", nargs=-1, required=True)
@json_option
@pass_ctx
def rm(obj: Context, refs: tuple[str, ...], as_json: bool) -> None:
    """Delete refs. Their chunks stay until `cas gc` finds them unreferenced.

    A ref whose record cannot be read is removed all the same (its manifest: null).
    """
    from cas.errors import FormatError, IntegrityError

    repo = obj.open(create=False)
    unreadable = set()
    for ref in refs:  # a typo in one name removes none of them
        try:
            repo.resolve(ref)
        except (FormatError, IntegrityError):  # damaged (a sealed one fails its tag)
            unreadable.add(ref)
    removed = [
        {"ref": r, "manifest": None if r in unreadable else repo.rm(r)}
        for r in refs
        if r not in unreadable or repo.rm_damaged(r)
    ]
    if as_json:
        emit_json(removed)
    else:
        for row in removed:
            was = row["manifest"][:16] if row["manifest"] else "an unreadable record"
            click.echo(f"removed {row['ref']} (was {was})")


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
