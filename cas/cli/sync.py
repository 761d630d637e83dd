"""Transfer commands: push, pull and archive refs between this store and another (S3 or any URL)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from cas.cli.app import (
    Context,
    byte_bar,
    cli,
    emit_json,
    human_bytes,
    json_option,
    pass_ctx,
    ref_argument,
)

codec_option = click.option(
    "--codec", default="keep", show_default=True, metavar="NAME",
    help="Re-encode copied chunks (raw, shuffle-zstd, shuffle-lz4, zstd, auto); keep copies them as stored.",
)  # fmt: skip
jobs_option = click.option(
    "-j", "--jobs", type=click.IntRange(1, 256), default=16, show_default=True,
    help="Parallel copies.",
)  # fmt: skip


@contextmanager
def _transfer_bar(obj: Context, desc: str) -> Iterator[Callable[[int, int], None]]:
    """A byte bar counting moved + skipped, with both shown separately."""
    totals = {"moved": 0, "skipped": 0}
    with byte_bar(obj, None, desc) as bar:

        def update(moved: int, skipped: int) -> None:
            totals["moved"] += moved
            totals["skipped"] += skipped
            bar.set_postfix_str(
                f"moved {human_bytes(totals['moved'])}, skipped {human_bytes(totals['skipped'])}",
                refresh=False,
            )
            bar.update(moved + skipped)

        yield update


def _print_report(report: Any, verb: str) -> None:
    for ref in report.refs:
        click.echo(f"{ref.status:<9} {ref.name} -> {ref.new[:16]}")
    click.echo(
        f"{verb} {human_bytes(report.bytes_moved)} in {report.chunks_moved} chunks "
        f"({human_bytes(report.wire_bytes)} stored), skipped {human_bytes(report.bytes_skipped)} "
        f"in {report.chunks_skipped} chunks already there; {report.refs_updated} refs updated "
        f"in {report.seconds:.1f} s"
    )


def _open_or_create_like(obj: Context, spec: str, like: Any) -> Any:
    """The store ``spec`` names (a remote of ``like`` or of the user, a URL, a path); a new one
    there is made with ``like``'s settings (chunking, codec)."""
    from cas.errors import NotFound

    try:
        return obj.open_remote(spec, like, create=False)
    except NotFound:
        return obj.open_remote(spec, like, config=like.config)


@cli.command()
@ref_argument("refs", nargs=-1, required=True)
@click.option(
    "--to",
    "url",
    required=True,
    metavar="REMOTE|URL",
    help="Destination: a remote's name (`cas remote add`), s3://... or a path.",
)
@codec_option
@jobs_option
@json_option
@pass_ctx
def push(
    obj: Context, refs: tuple[str, ...], url: str, codec: str, jobs: int, as_json: bool
) -> None:
    """Copy REFS (names, prefixes or globs like 'runs/r1/**') to the store at URL.

    Only chunks the destination lacks are sent; its refs move last, by compare-and-swap.
    Interrupted, run it again: it sends only the rest.
    """
    local = obj.open(create=False)
    remote = _open_or_create_like(obj, url, local)
    with _transfer_bar(obj, f"push {url}") as update:
        report = local.push(remote, list(refs), jobs=jobs, progress=update, codec=codec)
    if as_json:
        emit_json(report.as_dict())
    else:
        _print_report(report, "sent")


@cli.command()
@click.argument("refs", nargs=-1, required=True)
@click.option(
    "--from",
    "url",
    required=True,
    metavar="REMOTE|URL",
    help="Source: a remote's name (`cas remote add`), s3://... or a path.",
)
@codec_option
@jobs_option
@json_option
@pass_ctx
def pull(
    obj: Context, refs: tuple[str, ...], url: str, codec: str, jobs: int, as_json: bool
) -> None:
    """Copy REFS (names, prefixes or globs) from the store at URL (or a remote) into this one."""
    from cas.errors import NotFound

    try:
        local = obj.open(create=False)
    except NotFound:
        local = None
    remote = obj.open_remote(url, local, create=False, readonly=True)
    if local is None:
        local = obj.open_url(obj.store_url(), config=remote.config)
    with _transfer_bar(obj, f"pull {url}") as update:
        report = local.pull(remote, list(refs), jobs=jobs, progress=update, codec=codec)
    if as_json:
        emit_json(report.as_dict())
    else:
        _print_report(report, "received")


@cli.command()
@ref_argument("refs", nargs=-1, required=True)
@click.option(
    "--to",
    "url",
    required=True,
    metavar="REMOTE|URL",
    help="Archive store: a remote's name (`cas remote add`) or s3://....",
)
@click.option(
    "--grace", default="0", show_default=True, metavar="DURATION",
    help="Keep local chunks touched this recently (e.g. 1h).",
)  # fmt: skip
@codec_option
@jobs_option
@json_option
@pass_ctx
def archive(
    obj: Context,
    refs: tuple[str, ...],
    url: str,
    grace: str,
    codec: str,
    jobs: int,
    as_json: bool,
) -> None:
    """Push REFS to URL, remove them here, and free local chunks no remaining ref needs.

    Bring one back with `cas pull REF --from URL`.
    """
    from cas.units import parse_duration

    try:
        grace_seconds = parse_duration(grace)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--grace") from e
    local = obj.open(create=False)
    remote = _open_or_create_like(obj, url, local)
    with _transfer_bar(obj, f"archive {url}") as update:
        report = local.archive(
            remote, list(refs), jobs=jobs, progress=update, grace=grace_seconds, codec=codec
        )
    if as_json:
        emit_json(report.as_dict())
        return
    _print_report(report.transfer, "sent")
    for name in report.kept_refs:
        click.echo(f"kept      {name} (it moved meanwhile; not removed here)")
    click.echo(
        f"removed {len(report.removed_refs)} local refs, freed {human_bytes(report.freed_bytes)} "
        f"({report.freed_chunks} chunks, {report.freed_manifests} manifests); "
        f"{report.kept_chunks} chunks still used locally"
    )
    if report.note:
        click.echo(report.note, err=True)
