"""``cas history``: a run's training history as a table, JSON or CSV, read without torch."""

from __future__ import annotations

import csv
import json
import sys
from typing import Any

import click

from cas.cli.app import Context, cli, emit_json, pass_ctx, ref_argument

FIRST_COLUMNS = ("step", "event")


@cli.command()
@ref_argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the records as a JSON list.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV: one column per (flattened) key.")
@click.option("--event", "events", multiple=True, metavar="NAME", help="Only these events.")
@pass_ctx
def history(obj: Context, ref: str, as_json: bool, as_csv: bool, events: tuple[str, ...]) -> None:
    """The training history of a run: REF is its history ref or the run (runs/<id>).

    Nested values such as metrics become columns like metrics.loss; a record without a value
    for a column leaves it empty.

    \b
    Examples:
      cas history runs/20260115_143022_a1b2c3d4
      cas history runs/r1 --csv > history.csv
      cas history runs/r1/history --json --event save
    """
    if as_json and as_csv:
        raise click.UsageError("--json and --csv are exclusive")
    repo = obj.open(create=False, readonly=True)
    records = _read_history(repo, ref)
    if events:
        records = [r for r in records if r.get("event") in events]
    if as_json:
        emit_json(records)
        return
    rows = [_flatten(record) for record in records]
    columns = _columns(rows)
    if as_csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(row.get(c), csv_cell=True) for c in columns])
        return
    table = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(line[i]) for line in table)]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for line in table:
        click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def _read_history(repo: Any, ref: str) -> list[dict[str, Any]]:
    """The records under ``ref``, else under ``ref/history``; NotFound if neither holds any."""
    from cas.errors import FormatError, NothingSelected
    from cas.training.history import TrainingHistory

    tried = [ref] if ref.endswith("/history") or ref == "history" else [ref, f"{ref}/history"]
    for name in tried:
        if repo.find_ref(name) is None:
            continue
        try:
            return TrainingHistory(repo, name).read()
        except FormatError:
            if name == tried[-1]:
                raise
    raise NothingSelected(f"no training history at {' or '.join(tried)}")


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """``step`` and ``event`` first, then every other key in the order it first appears."""
    seen = dict.fromkeys(c for c in FIRST_COLUMNS if any(c in row for row in rows))
    for row in rows:
        seen.update(dict.fromkeys(row))
    return list(seen)


def _cell(value: Any, *, csv_cell: bool = False) -> str:
    if value is None:
        return "" if csv_cell else "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value) if csv_cell else f"{value:.6g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)
