"""Core commands: put, get, ls, log, cp, rm, verify (init: ``store``; show, cat, diff: ``content``)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import click

from cas.cli.app import (
    Context,
    cli,
    emit_json,
    human_bytes,
    json_option,
    pass_ctx,
    progress_bar,
    ref_argument,
    require_refs,
    utc_time,
    warn_damaged,
)


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@cli.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@ref_argument("ref")
@click.option("-m", "--message", default="", help="What this checkpoint is (shown by ls -l, log).")
@click.option(
    "-t", "--tag", "tags", multiple=True, metavar="TAG", help="A label to find it by (repeatable)."
)
@click.option(
    "--meta",
    "--metadata",
    "meta",
    multiple=True,
    metavar="KEY=VALUE",
    help="Metadata to record (repeatable). -m, once short for this, is now --message.",
)
@click.option(
    "--allow-opaque-pickles",
    "allow_pickles",
    is_flag=True,
    help="Store pickles that are not weights-only (e.g. HF training_args.bin) as opaque bytes; cas never loads them.",
)
@click.option(
    "--codec",
    default=None,
    help="Codec for new chunks: raw, shuffle-zstd, shuffle-lz4, zstd, auto (per tensor, deltas "
    "against --parent's keyframe), xor-shuffle-zstd, sub-shuffle-zstd [the store's].",
)
@click.option(
    "--parent",
    default=None,
    metavar="REF",
    help="Checkpoint whose same-named tensors are delta bases [REF's current version].",
)
@click.option(
    "-f",
    "--force",
    is_flag=True,
    help="Replace REF even if it is a gate, a best pointer or a ref the policy protects.",
)
@json_option
@pass_ctx
def put(
    obj: Context,
    path: Path,
    ref: str,
    message: str,
    tags: tuple[str, ...],
    meta: tuple[str, ...],
    allow_pickles: bool,
    codec: str | None,
    parent: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Ingest PATH (a .pt, .safetensors, any file, or a directory) under REF.

    Known formats are cut at tensor boundaries, so their tensors share chunks with the same
    tensors saved from Python. `.pt` files are checked with weights_only loading: a pickle that
    would run code is refused. A gate (gates/**, runs/*/gates/*), a best pointer or a ref the
    stored retention policy protects is never replaced without --force.
    """
    from cas.errors import ProtectedRef, RefusedPickle

    metadata = _parse_meta(meta)
    repo = obj.open()
    with progress_bar(obj, _tree_size(path), f"put {path.name}") as update:
        try:
            digest = repo.put_path(
                path,
                ref,
                metadata,
                allow_opaque_pickles=allow_pickles,
                codec=codec,
                parent=parent,
                progress=update,
                overwrite=force,
                message=message,
                tags=tags,
            )
        except RefusedPickle as e:
            raise e.for_option("--allow-opaque-pickles") from None
        except ProtectedRef as e:
            raise e.for_option("--force") from None
    stats = repo.last_write.as_dict()
    if as_json:
        emit_json({"ref": ref, "manifest": digest, **stats})
    else:
        click.echo(
            f"{ref} -> {digest[:16]}  {human_bytes(stats['logical_bytes'])} in, "
            f"{human_bytes(stats['new_bytes'])} new ({stats['new_chunks']} new chunks, "
            f"{stats['reused_chunks']} reused)"
        )


def _parse_meta(items: tuple[str, ...]) -> dict[str, Any]:
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--meta")
        try:  # NaN/Infinity stay strings: JSON has no such numbers
            out[key] = json.loads(value, parse_constant=str)
        except ValueError:
            out[key] = value
    return out


@cli.command()
@ref_argument("ref")
@click.argument("dest", type=click.Path(path_type=str))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "pt"]),
    default=None,
    help="Export a state saved from Python as this format [pt].",
)
@click.option(
    "--sha256", is_flag=True, help="Also write GNU coreutils .sha256 sidecars (sha256sum -c)."
)
@click.option("-f", "--force", is_flag=True, help="Overwrite existing files.")
@click.option(
    "-i",
    "--include",
    multiple=True,
    metavar="GLOB",
    help="Only the files whose path or name match (e.g. 'model*.safetensors'; repeatable).",
)
@json_option
@pass_ctx
def get(
    obj: Context,
    ref: str,
    dest: str,
    fmt: str | None,
    sha256: bool,
    force: bool,
    include: tuple[str, ...],
    as_json: bool,
) -> None:
    """Write REF to DEST: ingested files come back byte-identical, with their modes and
    modification times.

    REF may be a name, NAME~N (N versions back) or a manifest digest. DEST ending in / is a
    directory (made if needed) that a single file is written into. One file to stdout: `cas cat`.
    """
    repo = obj.open(create=False)
    manifest = repo.manifest(ref)
    with progress_bar(obj, manifest.logical_bytes(), f"get {ref}") as update:
        written = repo.get_path(
            ref, dest, fmt=fmt, sha256=sha256, overwrite=force, progress=update, include=include
        )
    if as_json:
        emit_json({"ref": ref, "written": [str(p) for p in written]})
    else:
        for path in written:
            click.echo(str(path))


@cli.command(name="ls")
@ref_argument("prefix", default="")
@click.option("-l", "--long", "long_", is_flag=True, help="Show size, time, tags and message.")
@click.option(
    "-w",
    "--where",
    multiple=True,
    metavar="COND",
    help="Only checkpoints whose metadata satisfy KEY OP VALUE, OP one of >= <= > < == != "
    "(e.g. 'step>=1000'; repeatable, all must hold).",
)
@click.option(
    "-t", "--tag", "tags", multiple=True, metavar="TAG", help="Only checkpoints with this tag."
)
@json_option
@pass_ctx
def ls_(
    obj: Context,
    prefix: str,
    long_: bool,
    where: tuple[str, ...],
    tags: tuple[str, ...],
    as_json: bool,
) -> None:
    """List refs under PREFIX (a prefix like runs/r1, or a glob like 'runs/*/phase2/**').

    --where and --tag read each ref's manifest (no tensor data). A ref whose record or manifest
    cannot be read is named in a warning on stderr and the rest are listed; the exit status
    stays 0 (`cas verify` fails on it).
    """
    from cas.errors import CASError
    from cas.model.where import matches_all, parse_conditions

    try:
        conditions = parse_conditions(where)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--where") from None
    filtered = bool(conditions or tags)
    repo = obj.open(create=False, readonly=True)
    listing = repo.list_refs(prefix)
    warnings = [str(d) for d in listing.damaged]
    rows = []
    for record in listing.records:
        row: dict[str, Any] = {
            "ref": record.name,
            "manifest": record.target,
            "updated": record.history[-1].time,
        }
        if long_ or as_json or filtered:
            try:
                manifest = repo.manifest(record.target)
            except CASError as e:
                row["error"] = f"manifest {record.target[:16]}: {e}"
                warnings.append(f"{record.name}: {row['error']}")
            else:
                row.update(
                    kind=manifest.kind,
                    logical_bytes=manifest.logical_bytes(),
                    meta=manifest.meta,
                    message=manifest.message,
                    tags=list(manifest.tags),
                )
            if filtered and not (
                "meta" in row
                and set(tags) <= set(row["tags"])
                and matches_all(conditions, row["meta"])
            ):
                continue
        rows.append(row)
    if as_json:
        emit_json(rows)
    for row in [] if as_json else rows:
        if long_:
            step = row["meta"].get("step", "") if "meta" in row else ""
            size = human_bytes(row["logical_bytes"]) if "logical_bytes" in row else "?"
            labels = "".join(f" [{t}]" for t in row.get("tags", ()))
            message = f"  {row['message']}" if row.get("message") else ""
            click.echo(
                f"{row['manifest'][:12]}  {utc_time(row['updated'])}  {size:>10}  {step!s:>8}  "
                f"{row['ref']}{labels}{message.splitlines()[0] if message else ''}"
            )
        else:
            click.echo(row["ref"])
    warn_damaged(warnings)


@cli.command()
@ref_argument("ref")
@click.option(
    "-n",
    "--max-count",
    type=click.IntRange(min=1),
    default=None,
    help="Show only the newest N entries (a ref keeps up to 10,000).",
)
@json_option
@pass_ctx
def log(obj: Context, ref: str, max_count: int | None, as_json: bool) -> None:
    """History of REF, newest first (REF~N addresses entry N).

    If part of the history cannot be read (a damaged sealed segment), the events before it are
    shown, then one warning line, and the exit status is 1. An unreadable entry of the recent
    history is left out and named in a warning line (exit status 0).
    """
    from cas.errors import CASError
    from cas.refs.records import MAX_STORED_HISTORY, RefEvent

    repo = obj.open(create=False, readonly=True)
    events: list[RefEvent] = []
    damage: CASError | None = None
    record = repo.find_ref(ref)
    history = repo.ref_events(ref if record is None else record)
    try:
        for event in itertools.islice(history, max_count):
            events.append(event)
    except CASError as error:
        damage = error
    tags = _event_tags(repo, events)
    if as_json:
        emit_json(
            [
                {
                    "n": i,
                    "manifest": e.target,
                    "time": e.time,
                    "op": e.op,
                    "message": e.message,
                    "tags": tags.get(e.target, []),
                }
                for i, e in enumerate(events)
            ]
        )
    else:
        for i, e in enumerate(events):
            labels = "".join(f" [{t}]" for t in tags.get(e.target, ()))
            click.echo(
                f"{ref}~{i:<4} {e.target[:16]}  {utc_time(e.time)}  {e.op:<6} {e.message}{labels}"
            )
    record = repo.find_ref(ref)
    if record is not None:  # shown around: the rest of the history stands (`cas repair`)
        warn_damaged(f"{ref}: {problem} (not shown)" for problem in record.problems())
    if damage is not None:
        warn_damaged([f"older history of {ref}: {damage}"])
        sys.exit(1)
    if record is not None and record.ignored_history and max_count is None:
        warn_damaged(
            [
                f"all of {ref}'s history: its record lists {record.ignored_history} more events "
                f"(segments repeated, or past the {MAX_STORED_HISTORY:,} a reader takes); "
                "the next change of the ref drops them"
            ]
        )
        sys.exit(1)


def _event_tags(repo: Any, events: list[Any]) -> dict[str, list[str]]:
    """The tags of each checkpoint a history names, read from its manifest once; one that
    cannot be read (collected by GC, damaged) has none here: `log` lists history, `verify`
    judges it."""
    from cas.errors import CASError

    out: dict[str, list[str]] = {}
    for target in dict.fromkeys(e.target for e in events):
        try:
            out[target] = list(repo.manifest(target).tags)
        except CASError:
            out[target] = []
    return out


@cli.command()
@ref_argument("src")
@ref_argument("dst")
@click.option(
    "--only",
    multiple=True,
    metavar="GLOB",
    help="Keep only entries matching (e.g. 'model.*'): a weights-only snapshot.",
)
@click.option(
    "-f",
    "--force",
    is_flag=True,
    help="Replace DST even if it is a gate, a best pointer or a ref the policy protects.",
)
@json_option
@pass_ctx
def cp(obj: Context, src: str, dst: str, only: tuple[str, ...], force: bool, as_json: bool) -> None:
    """Point DST at SRC's checkpoint: a gate or pool copy that writes no chunk.

    A gate (gates/**, runs/*/gates/*), a best pointer or a ref the stored retention policy
    protects is never replaced without --force.
    """
    from cas.errors import ProtectedRef

    repo = obj.open(create=False)
    try:
        digest = repo.cp(src, dst, only=list(only) or None, overwrite=force)
    except ProtectedRef as e:
        raise e.for_option("--force") from None
    if as_json:
        emit_json({"ref": dst, "manifest": digest})
    else:
        click.echo(f"{dst} -> {digest[:16]}")


@cli.command()
@ref_argument("refs", nargs=-1)
@click.option("--full", is_flag=True, help="Re-read and re-hash every chunk, and check its size.")
@click.option(
    "--sample",
    type=click.FloatRange(0, 100, min_open=True),
    default=None,
    metavar="PCT",
    help="Re-hash a rotating PCT% of chunks.",
)
@click.option(
    "--repair-from",
    "repair_url",
    default=None,
    metavar="REMOTE|URL",
    help="Copy good copies of missing or corrupt objects from this store or remote "
    "(implies --full).",
)
@json_option
@pass_ctx
def verify(
    obj: Context,
    refs: tuple[str, ...],
    full: bool,
    sample: float | None,
    repair_url: str | None,
    as_json: bool,
) -> None:
    """Check that REFS (default: all) have their manifest and every chunk; exit 1 on any problem.

    --full and --sample move what they find corrupt into the store's quarantine, so the next
    save of the same data writes it again; --repair-from restores it from another store. A REF
    (a name, prefix or glob) that selects no ref is an error.
    """
    if repair_url is not None:
        _verify_and_repair(obj, refs, repair_url, as_json)
        return
    repo = obj.open(create=False, readonly=not (sample or full))
    require_refs(repo, refs)
    level = "full" if full else "sample" if sample else "existence"
    with progress_bar(obj, None, "verify") as update:
        report = repo.verify(refs or ("",), level=level, sample_pct=sample or 0.0, progress=update)
    if as_json:
        emit_json({"ok": report.ok, "level": level, **_verify_dict(report)})
    else:
        _print_verify(report)
    if not report.ok:
        sys.exit(1)


def _verify_dict(report: Any) -> dict[str, Any]:
    return {
        "refs": report.refs,
        "manifests": report.manifests,
        "chunks": report.chunks,
        "rehashed_chunks": report.rehashed_chunks,
        "rehashed_bytes": report.rehashed_bytes,
        "quarantined": report.quarantined,
        "problems": [{**p.__dict__, "refs": list(p.refs)} for p in report.problems],
        "broken_refs": report.broken_refs(),
    }


def _print_verify(report: Any) -> None:
    for problem in report.problems:
        click.echo(f"PROBLEM {problem}", err=True)
    quarantined = f", {report.quarantined} quarantined" if report.quarantined else ""
    click.echo(
        f"{'ok' if report.ok else 'FAILED'}: {report.refs} refs, {report.manifests} manifests, "
        f"{report.chunks} chunks present-checked, {report.rehashed_chunks} re-hashed "
        f"({human_bytes(report.rehashed_bytes)}), {len(report.problems)} problems{quarantined}"
    )


def _verify_and_repair(obj: Context, refs: tuple[str, ...], url: str, as_json: bool) -> None:
    """``verify --full --repair-from URL``: heal from another store, report what stays broken."""
    repo = obj.open(create=False)
    source = obj.open_remote(url, repo, create=False, readonly=True)
    with progress_bar(obj, None, "verify") as update:
        result = repo.repair_from(source, refs or ("",), progress=update)
    if as_json:
        emit_json(
            {
                "ok": result.ok,
                "level": "full",
                "source": result.source,
                **_verify_dict(result.before),
                "healed": [h.__dict__ for h in result.healed],
                "unhealed": [u.__dict__ for u in result.unhealed],
                "still_broken": result.broken_refs(),
            }
        )
    else:
        _print_verify(result.before)
        for healed in result.healed:
            click.echo(f"healed {healed.kind} {healed.digest} ({healed.how} from {result.source})")
        for unhealed in result.unhealed:
            click.echo(f"NOT HEALED {unhealed.kind} {unhealed.digest}: {unhealed.reason}", err=True)
        broken = result.broken_refs()
        click.echo(
            f"{'repaired' if result.ok else 'FAILED'}: {len(result.healed)} objects healed, "
            f"{len(broken)} refs still broken{': ' + ', '.join(broken) if broken else ''}"
        )
    if not result.ok:
        sys.exit(1)
