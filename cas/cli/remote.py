"""The remote commands: named stores for push, pull, archive and verify --repair-from."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from cas.cli.app import Context, cli, emit_json, json_option, pass_ctx

if TYPE_CHECKING:
    from cas.cli.settings import Remote

scope_option = click.option(
    "--global",
    "user",
    is_flag=True,
    help="In your config file ($XDG_CONFIG_HOME/cas/config.toml) for every store, rather than "
    "in this store's config.",
)


@cli.group()
def remote() -> None:
    """Named stores: `cas push REF --to NAME`, `cas pull REF --from NAME`, `archive --to NAME`.

    \b
    A remote is kept in the store's own config (it travels with the store) or, with --global,
    in your config file; the store's wins over yours of the same name. Credentials are never
    kept: S3 gets them from the AWS chain (AWS_PROFILE, ~/.aws/credentials, an instance role).
    \b
      cas remote add archive s3://bucket/ckpts --endpoint-url http://localhost:8333
      cas push 'runs/r1/**' --to archive
    """


@remote.command("add")
@click.argument("name")
@click.argument("url")
@scope_option
@click.option("-f", "--force", is_flag=True, help="Replace a remote of that name.")
@json_option
@click.pass_context
def remote_add(
    ctx: click.Context, name: str, url: str, user: bool, force: bool, as_json: bool
) -> None:
    """Name the store at URL (s3://bucket/prefix, a path); --endpoint-url given here is kept
    with it (AWS_ENDPOINT_URL from the environment is not). A path is kept absolute."""
    from cas.cli.settings import Remote, check_remote_name
    from cas.errors import AlreadyExists

    obj = ctx.find_object(Context)
    assert obj is not None  # the root command made it
    check_remote_name(name)
    if "://" not in url:  # a relative path would move with the working directory
        url = str(Path(url).expanduser().absolute())
    root = ctx.find_root()
    given = root.get_parameter_source("endpoint_url") == click.core.ParameterSource.COMMANDLINE
    new = Remote(name, url, obj.endpoint_url if given else None, "user" if user else "store")
    existing = _remotes(obj, user, missing_store_ok=True)
    if name in existing and not force:
        raise AlreadyExists(f"remote {name!r} exists ({existing[name].url}); --force replaces it")
    _save(obj, user, {**existing, name: new})
    if as_json:
        emit_json(new.to_dict())
    else:
        where = "your config" if user else "the store's config"
        endpoint = f" (endpoint {new.endpoint_url})" if new.endpoint_url else ""
        click.echo(f"remote {name} -> {url}{endpoint}, in {where}")


@remote.command("list")
@json_option
@pass_ctx
def remote_list(obj: Context, as_json: bool) -> None:
    """The remotes this store sees: its own, then yours (the store's wins on a shared name)."""
    own = _remotes(obj, user=False, missing_store_ok=True)
    user = {n: r for n, r in _remotes(obj, user=True).items() if n not in own}
    rows = [*own.values(), *user.values()]
    if as_json:
        emit_json([r.to_dict() for r in rows])
        return
    for r in rows:
        endpoint = f"  (endpoint {r.endpoint_url})" if r.endpoint_url else ""
        click.echo(f"{r.name:<16} {r.url}{endpoint}  [{r.scope}]")


@remote.command("remove")
@click.argument("name")
@scope_option
@json_option
@pass_ctx
def remote_remove(obj: Context, name: str, user: bool, as_json: bool) -> None:
    """Forget the remote NAME (the store it names is not touched)."""
    from cas.errors import NotFound

    existing = _remotes(obj, user)
    if name not in existing:
        where = "your config" if user else "the store's config (--global: yours)"
        raise NotFound(f"no remote {name!r} in {where}")
    _save(obj, user, {n: r for n, r in existing.items() if n != name})
    if as_json:
        emit_json({"removed": name})
    else:
        click.echo(f"removed remote {name}")


def _remotes(obj: Context, user: bool, missing_store_ok: bool = False) -> dict[str, Remote]:
    """The user's remotes, or the store's (none when there is no store and that is fine)."""
    from cas.cli.settings import store_remotes
    from cas.errors import NotFound

    if user:
        return dict(obj.user_config().remotes)
    try:
        repo = obj.open(create=False, readonly=True)
    except NotFound:
        if missing_store_ok:
            return {}
        raise
    return store_remotes(repo.config.extra)


def _save(obj: Context, user: bool, remotes: dict[str, Remote]) -> None:
    from dataclasses import replace

    from cas.cli.settings import STORE_SECTION, store_section, write_user_config

    if user:
        write_user_config(replace(obj.user_config(), remotes=remotes))
    else:
        obj.open().update_config(STORE_SECTION, store_section(remotes))
