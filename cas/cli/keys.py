"""``cas key``: list, add, remove and replace the passphrases that open an encrypted store."""

from __future__ import annotations

import sys
from typing import Any

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx
from cas.errors import CASError


@cli.group()
def key() -> None:
    """The passphrases that open an encrypted store (as restic's `key`).

    The store's data is sealed under one random master key; each passphrase opens a wrapped
    copy of it, so adding, removing or changing one rewrites no data. The current passphrase
    comes from CAS_KEY, CAS_KEY_FILE or CAS_KEY_COMMAND; a new one from --new-key-file, else
    it is asked for on a terminal.
    """


def _encrypted(obj: Context) -> Any:
    repo = obj.open(create=False)
    if repo.store_key is None:
        repo.close()
        raise CASError(f"the store at {repo.url} is not encrypted (`cas init --encrypt`)")
    return repo


def _new_passphrase(path: str | None) -> str:
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    if not sys.stdin.isatty():
        raise click.UsageError(
            "give the new passphrase with --new-key-file (no terminal to ask on)"
        )
    answer: str = click.prompt("new passphrase", hide_input=True, confirmation_prompt=True)
    return answer


new_key_option = click.option(
    "--new-key-file", metavar="FILE", help="Read the new passphrase from FILE's first line."
)


@key.command("list")
@json_option
@pass_ctx
def key_list(obj: Context, as_json: bool) -> None:
    """The store's keys: id, when and where each was added; * marks the one in use."""
    from cas.repo.keys import list_keys

    repo = _encrypted(obj)
    slots = list_keys(repo)
    if as_json:
        emit_json([{**s.to_dict(), "current": s.id == repo.key_slot} for s in slots])
        return
    import datetime as dt

    for s in slots:
        when = dt.datetime.fromtimestamp(s.created_at, tz=dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M"
        )
        mark = "*" if s.id == repo.key_slot else " "
        click.echo(f"{mark} {s.id}  {when} UTC  {s.user}@{s.host}")


@key.command("add")
@new_key_option
@json_option
@pass_ctx
def key_add(obj: Context, new_key_file: str | None, as_json: bool) -> None:
    """Add a passphrase that opens the store too."""
    from cas.repo.keys import add_key

    repo = _encrypted(obj)
    slot = add_key(repo, _new_passphrase(new_key_file))
    if as_json:
        emit_json(slot.to_dict())
    else:
        click.echo(f"added key {slot.id}")


@key.command("remove")
@click.argument("key_id")
@json_option
@pass_ctx
def key_remove(obj: Context, key_id: str, as_json: bool) -> None:
    """Remove key KEY_ID (not the one in use, nor the last)."""
    from cas.repo.keys import remove_key

    repo = _encrypted(obj)
    remove_key(repo, key_id)
    if as_json:
        emit_json({"removed": key_id})
    else:
        click.echo(f"removed key {key_id}")


@key.command("passwd")
@new_key_option
@json_option
@pass_ctx
def key_passwd(obj: Context, new_key_file: str | None, as_json: bool) -> None:
    """Replace the passphrase in use: add the new one, then remove the old one."""
    from cas.repo.keys import add_key, remove_key

    repo = _encrypted(obj)
    old = repo.key_slot
    slot = add_key(repo, _new_passphrase(new_key_file))
    remove_key(repo, old, allow_current=True)
    if as_json:
        emit_json({"added": slot.id, "removed": old})
    else:
        click.echo(f"key {old} replaced by {slot.id}")
