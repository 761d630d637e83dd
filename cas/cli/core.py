"""Core commands: init, put, get, ls, show, log, cp, rm, diff, verify."""

from __future__ import annotations

import datetime as dt
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
    warn_damaged,
)


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@cli.command()
@click.option("--chunk-size", type=int, default=None, help="Tensor chunk size in bytes [4 MiB].")
@click.option(
    "--codec",
    default=None,
    help="Default codec for new chunks: raw (hot, memory-mappable), shuffle-zstd, shuffle-lz4 "
    "(faster, larger), zstd, or auto (per tensor, deltas against the last keyframe) [raw].",
)
@click.option(
    "--encrypt",
    is_flag=True,
    help="Encrypt everything stored, names included (passphrase: CAS_KEY, CAS_KEY_FILE, "
    "CAS_KEY_COMMAND, else asked for).",
)
@click.option(
    "--key-from",
    metavar="URL",
    help="With --encrypt: use the master key of this encrypted store, so the two dedup "
    "against each other and push/pull copies objects as they are.",
)
@click.option(
    "--append-only",
    is_flag=True,
    help="Every handle of the store refuses forget, gc and rm (a maintenance host changes "
    "the setting with the store's config).",
)
@json_option
@pass_ctx
def init(
    obj: Context,
    chunk_size: int | None,
    codec: str | None,
    encrypt: bool,
    key_from: str | None,
    append_only: bool,
    as_json: bool,
) -> None:
    """Create a store (other commands create one on first use too).

    \b
    Examples:
      cas --store s3://bucket/ckpt init --encrypt        # asks for a passphrase
      CAS_KEY_COMMAND='pass show cas' cas init --encrypt
      cas --store /nvme/cas init --encrypt --key-from s3://bucket/ckpt
    """
    from dataclasses import replace

    from cas.objects.encoding import standalone_codec
    from cas.repo.config import StoreConfig

    if key_from and not encrypt:
        raise click.UsageError("--key-from goes with --encrypt")
    config = StoreConfig()
    if append_only:
        config = replace(config, extra={**config.extra, "append_only": True})
    if chunk_size is not None:
        config = replace(config, chunk_size=chunk_size)
    if codec:
        standalone_codec(codec, 1)  # an unknown name is an error here
        config = replace(config, codec=codec)
    from cas.errors import AlreadyExists, NotFound
    from cas.repo.opening import open as open_store

    try:  # an existing store's settings are compared below, with the options given
        repo = open_store(obj.store, create=False)
    except NotFound:
        secrets: dict[str, Any] = {}
        if encrypt:
            secrets = {"encrypt": True, "key": _new_passphrase()}
            if key_from:
                secrets["key_from"] = open_store(key_from, create=False, readonly=True)
        repo = open_store(obj.store, config=config.validate(), **secrets)
    else:
        if encrypt and repo.store_key is None:
            raise AlreadyExists(f"a plain store already exists at {repo.url}")
    asked = {"chunk_size": chunk_size, "codec": codec}
    ignored = [k for k, v in asked.items() if v is not None and getattr(repo.config, k) != v]
    if ignored:
        raise AlreadyExists(
            f"a store already exists at {repo.url} with another {' and '.join(ignored)} "
            f"({', '.join(f'{k} {getattr(repo.config, k)}' for k in ignored)})"
        )
    if as_json:
        emit_json(
            {
                "store": repo.url,
                "config": repo.config.__dict__,
                "encrypted": repo.store_key is not None,
            }
        )
    else:
        sealed = ", encrypted" if repo.store_key is not None else ""
        click.echo(
            f"store {repo.url} (chunk size {human_bytes(repo.config.chunk_size)}, "
            f"codec {repo.config.codec}{sealed})"
        )


def _new_passphrase() -> str | None:
    """The passphrase from the environment, else asked for twice on a terminal; None lets the
    store say in one line where it looks for one."""
    import sys

    from cas.repo.keys import passphrase_from_environment

    found = passphrase_from_environment()
    if found is None and sys.stdin.isatty():
        found = click.prompt(
            "passphrase for the new store", hide_input=True, confirmation_prompt=True
        )
    return found


@cli.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@ref_argument("ref")
@click.option(
    "-m", "--meta", multiple=True, metavar="KEY=VALUE", help="Metadata to record (repeatable)."
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
@json_option
@pass_ctx
def get(
    obj: Context, ref: str, dest: str, fmt: str | None, sha256: bool, force: bool, as_json: bool
) -> None:
    """Write REF to DEST: ingested files come back byte-identical.

    REF may be a name, NAME~N (N versions back) or a manifest digest. DEST ending in / is a
    directory (made if needed) that a single file is written into.
    """
    repo = obj.open(create=False)
    manifest = repo.manifest(ref)
    with progress_bar(obj, manifest.logical_bytes(), f"get {ref}") as update:
        written = repo.get_path(ref, dest, fmt=fmt, sha256=sha256, overwrite=force, progress=update)
    if as_json:
        emit_json({"ref": ref, "written": [str(p) for p in written]})
    else:
        for path in written:
            click.echo(str(path))


@cli.command(name="ls")
@ref_argument("prefix", default="")
@click.option("-l", "--long", "long_", is_flag=True, help="Show size, time and metadata.")
@json_option
@pass_ctx
def ls_(obj: Context, prefix: str, long_: bool, as_json: bool) -> None:
    """List refs under PREFIX (a prefix like runs/r1, or a glob like 'runs/*/phase2/**').

    A ref whose record or manifest cannot be read is named in a warning on stderr and the rest
    are listed; the exit status stays 0 (`cas verify` fails on it).
    """
    from cas.errors import CASError

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
        if long_ or as_json:
            try:
                manifest = repo.manifest(record.target)
            except CASError as e:
                row["error"] = f"manifest {record.target[:16]}: {e}"
                warnings.append(f"{record.name}: {row['error']}")
            else:
                row.update(
                    kind=manifest.kind, logical_bytes=manifest.logical_bytes(), meta=manifest.meta
                )
        rows.append(row)
    if as_json:
        emit_json(rows)
    for row in [] if as_json else rows:
        if long_:
            step = row["meta"].get("step", "") if "meta" in row else ""
            size = human_bytes(row["logical_bytes"]) if "logical_bytes" in row else "?"
            click.echo(
                f"{row['manifest'][:12]}  {_when(row['updated'])}  {size:>10}  {step!s:>8}  {row['ref']}"
            )
        else:
            click.echo(row["ref"])
    warn_damaged(warnings)


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
    click.echo(f"created   {_when(info['created_at'])}\nparent    {info['parent'] or '-'}")
    click.echo(f"size      {human_bytes(info['logical_bytes'])} in {info['chunks']} chunks")
    stored = f"stored    {human_bytes(info['stored_bytes'])} (ratio {info['ratio']:.3f})"
    if info["base_chunks"]:
        stored += (
            f", {human_bytes(info['stored_with_bases'])} with {info['base_chunks']} delta bases"
        )
    if info["missing_chunks"]:
        stored += f", {info['missing_chunks']} chunks MISSING"
    click.echo(stored)
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
    shown, then one warning line, and the exit status is 1.
    """
    from cas.errors import CASError
    from cas.refs.records import RefEvent

    repo = obj.open(create=False, readonly=True)
    events: list[RefEvent] = []
    damage: CASError | None = None
    history = repo.ref_events(ref)
    try:
        for event in itertools.islice(history, max_count):
            events.append(event)
    except CASError as error:
        damage = error
    if as_json:
        emit_json(
            [
                {"n": i, "manifest": e.target, "time": e.time, "op": e.op, "message": e.message}
                for i, e in enumerate(events)
            ]
        )
    else:
        for i, e in enumerate(events):
            click.echo(f"{ref}~{i:<4} {e.target[:16]}  {_when(e.time)}  {e.op:<6} {e.message}")
    if damage is not None:
        warn_damaged([f"older history of {ref}: {damage}"])
        sys.exit(1)


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
@ref_argument("refs", nargs=-1, required=True)
@json_option
@pass_ctx
def rm(obj: Context, refs: tuple[str, ...], as_json: bool) -> None:
    """Delete refs. Their chunks stay until `cas gc` finds them unreferenced."""
    repo = obj.open(create=False)
    for ref in refs:  # a typo in one name removes none of them
        repo.resolve(ref)
    removed = [{"ref": r, "manifest": repo.rm(r)} for r in refs]
    if as_json:
        emit_json(removed)
    else:
        for row in removed:
            click.echo(f"removed {row['ref']} (was {row['manifest'][:16]})")


@cli.command()
@ref_argument("a")
@ref_argument("b")
@click.option("-a", "--all", "show_all", is_flag=True, help="List unchanged entries too (=).")
@json_option
@pass_ctx
def diff(obj: Context, a: str, b: str, show_all: bool, as_json: bool) -> None:
    """Entries that differ between checkpoints A and B (compared by chunk digests).

    The tensors inside ingested .pt and .safetensors files are compared one by one
    (FILE:TENSOR); two single ingested files are compared whatever their names.
    """
    repo = obj.open(create=False, readonly=True)
    changes = repo.diff(a, b, same=show_all)
    if as_json:
        emit_json([c.__dict__ for c in changes])
        return
    marks = {"added": "+", "removed": "-", "changed": "M", "retyped": "T", "same": "="}
    for c in changes:
        click.echo(f"{marks[c.change]} {c.path}")
    if not any(c.change != "same" for c in changes):
        click.echo("no differences")


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
    metavar="URL",
    help="Copy good copies of missing or corrupt objects from this store (implies --full).",
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
    source = obj.open_url(url, create=False, readonly=True)
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
