"""The completion command: click's shell completion script, ref names included."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

from cas.cli.app import cli

SHELLS = ("bash", "zsh", "fish")


@cli.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL; REF arguments complete the store's ref names.

    \b
    bash:  eval "$(cas completion bash)"                 (in ~/.bashrc)
    zsh:   eval "$(cas completion zsh)"                  (in ~/.zshrc)
    fish:  cas completion fish > ~/.config/fish/completions/cas.fish

    Ref names come from the store of --store or CAS_STORE at the time you press Tab.
    """
    cls = get_completion_class(shell)
    assert cls is not None  # click ships all three
    click.echo(cls(cli, {}, "cas", "_CAS_COMPLETE").source())
