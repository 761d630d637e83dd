"""The ``cas`` command line: one click group; each command module adds its commands to it."""

from __future__ import annotations

from cas.cli import core as _core  # noqa: F401  (registers commands)
from cas.cli.app import cli, main

__all__ = ["cli", "main"]
