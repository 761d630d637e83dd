"""``cas ui``: serve a read-only web view of the store on this machine."""

from __future__ import annotations

import json
import os

import click

from cas.cli.app import Context, cli, json_option, pass_ctx


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port to listen on (0: a free one).")  # fmt: skip
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind. Anything but loopback lets other machines reach it (with the token).",
)
@json_option
@pass_ctx
def ui(obj: Context, port: int, host: str, as_json: bool) -> None:
    """Look at runs, checkpoints, lineage, storage and retention in a browser.

    Serves the store read-only at a URL printed on start, with a random token in it (as
    Jupyter does): open that URL; a request without the token is refused. Pages: runs with
    their loss curves and checkpoints marked, one checkpoint's tensors and lineage, storage
    against the budget, the stored retention policy's plan, opponent pools. Every page also
    answers JSON (`Accept: application/json` or `?format=json`). CAS_UI_TOKEN sets the token.
    Runs in the foreground until Ctrl-C; with --json the first line it prints is
    {"store", "url", "port", "token"} for a script.

    \b
    Examples:
      cas ui                       # this machine only, a free port
      cas --store s3://bucket/prefix ui --port 8765
    """
    from cas.ui.server import UIServer

    repo = obj.open(create=False, readonly=True)
    try:
        server = UIServer(
            repo,
            label=repo.url,
            host=host,
            port=port,
            token=os.environ.get("CAS_UI_TOKEN") or None,
            log=None if obj.quiet else lambda line: click.echo(line, err=True),
        )
    except OSError as e:
        repo.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    server.warm()
    if as_json:
        started = {"store": repo.url, "url": server.url, "port": server.port, "token": server.token}
        click.echo(json.dumps(started))  # one line: a script reads it and goes on
    else:
        click.echo(f"cas ui: {repo.url} at {server.url}")
    click.echo("(read-only; Ctrl-C stops it)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        repo.close()
