"""Creating a store: ``cas init`` (chunking and codec, plain or encrypted, append-only)."""

from __future__ import annotations

from typing import Any

import click

from cas.cli.app import Context, cli, emit_json, human_bytes, json_option, pass_ctx


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

    try:  # an existing store's settings are compared below, with the options given
        repo = obj.open_url(obj.store_url(), create=False)
    except NotFound:
        secrets: dict[str, Any] = {}
        if encrypt:
            secrets = {"encrypt": True, "key": _new_passphrase()}
            if key_from:
                secrets["key_from"] = obj.open_url(key_from, create=False, readonly=True)
        repo = obj.open_url(obj.store_url(), config=config.validate(), **secrets)
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
