"""Commands that read what is inside a checkpoint: show (its table), cat (one file), diff."""

from __future__ import annotations

import sys
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
    utc_time,
)


@cli.command()
@ref_argument("ref")
@json_option
@pass_ctx
def show(obj: Context, ref: str, as_json: bool) -> None:
    """Metadata and tensor table of REF, read from the manifest alone (no tensor data)."""
    repo = obj.open(create=False, readonly=True)
    info = repo.show(ref)
    if as_json:
        emit_json(info)
        return
    click.echo(f"ref       {info['ref']}\nmanifest  {info['manifest']}\nkind      {info['kind']}")
    click.echo(f"created   {utc_time(info['created_at'])}\nparent    {info['parent'] or '-'}")
    click.echo(f"size      {human_bytes(info['logical_bytes'])} in {info['chunks']} chunks")
    stored = f"stored    {human_bytes(info['stored_bytes'])} (ratio {info['ratio']:.3f})"
    if info["base_chunks"]:
        stored += (
            f", {human_bytes(info['stored_with_bases'])} with {info['base_chunks']} delta bases"
        )
    if info["missing_chunks"]:
        stored += f", {info['missing_chunks']} chunks MISSING"
    click.echo(stored)
    if info["message"]:
        click.echo(f"message   {info['message']}")
    if info["tags"]:
        click.echo(f"tags      {' '.join(info['tags'])}")
    for key, value in info["meta"].items():
        click.echo(f"meta      {key} = {value}")
    for path, f in info["files"].items():
        click.echo(f"file      {path}  {f['format']}  {human_bytes(f['size'])}")
    if info["tensors"]:
        click.echo(f"{'dtype':<14} {'shape':<22} {'bytes':>10}  {'codec':<14}  path")
        for t in info["tensors"]:
            click.echo(
                f"{t['dtype']:<14} {list(t['shape'])!s:<22} {human_bytes(t['nbytes']):>10}  "
                f"{t['codec']:<14}  {t['path']}"
            )


@cli.command()
@ref_argument("spec", metavar="REF[/PATH]")
@pass_ctx
def cat(obj: Context, spec: str) -> None:
    """Write one ingested file to stdout, byte-identical: REF/PATH for a file of an ingested
    directory (`cas cat runs/r1/checkpoint-500/config.json`), REF for a single ingested file.

    Streams chunk by chunk, each verified before it is written; memory holds the few chunks
    read ahead, whatever the file's size.
    """
    repo = obj.open(create=False, readonly=True)
    chunks = repo.iter_file(spec)
    out = sys.stdout.buffer
    for chunk in chunks:
        out.write(chunk)
    out.flush()


@cli.command()
@ref_argument("a")
@ref_argument("b")
@click.option("-a", "--all", "show_all", is_flag=True, help="List unchanged entries too (=).")
@click.option(
    "--exit-code", is_flag=True, help="Exit 1 when A and B differ, 0 when they do not (as git)."
)
@json_option
@pass_ctx
def diff(obj: Context, a: str, b: str, show_all: bool, exit_code: bool, as_json: bool) -> None:
    """Entries that differ between checkpoints A and B (compared by chunk digests).

    The tensors inside ingested .pt and .safetensors files are compared one by one
    (FILE:TENSOR); two single ingested files are compared whatever their names. When no tensor
    names match but all of one side's start with one prefix (`model.w` against `w`), they are
    paired without it, and a note says so.
    """
    repo = obj.open(create=False, readonly=True)
    changes = repo.diff(a, b, same=show_all)
    differ = any(c.change != "same" for c in changes)
    if as_json:
        emit_json([c.__dict__ for c in changes])
    else:
        note = _pairing_note(changes, a, b)
        if note:
            click.echo(note)
        marks = {"added": "+", "removed": "-", "changed": "M", "retyped": "T", "same": "="}
        for c in changes:
            shown = f"{c.left_path} -> {c.path}" if c.left_path else c.path
            click.echo(f"{marks[c.change]} {shown}")
        if not differ:
            click.echo("no differences")
    if exit_code and differ:
        sys.exit(1)


def _pairing_note(changes: list[Any], a: str, b: str) -> str | None:
    """A line saying that tensors were paired under a renamed prefix, if they were."""
    paired = next((c for c in changes if c.left_path), None)
    if paired is None:
        return None
    left, right = paired.left_path.rpartition(":")[2], paired.path.rpartition(":")[2]
    if left == right:
        return f"note: paired the tensors of {a} and {b} by name (one side's are inside a file)"
    if left.endswith(right):
        return f"note: paired {a}'s tensors with {b}'s without the prefix {left[: -len(right)]!r}"
    return f"note: paired {b}'s tensors with {a}'s without the prefix {right[: -len(left)]!r}"
