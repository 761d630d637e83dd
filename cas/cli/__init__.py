"""The ``cas`` command line: one click group; each command module adds its commands to it."""

from __future__ import annotations

from cas.cli import content as _content  # noqa: F401  (show, cat, diff)
from cas.cli import core as _core  # noqa: F401  (registers commands)
from cas.cli import gc as _gc  # noqa: F401  (gc, du, stats, leases, unlock)
from cas.cli import history as _history  # noqa: F401  (history)
from cas.cli import keys as _keys  # noqa: F401  (key)
from cas.cli import mount as _mount  # noqa: F401  (mount)
from cas.cli import remote as _remote  # noqa: F401  (remote add, list, remove)
from cas.cli import repair as _repair  # noqa: F401  (rm, repair)
from cas.cli import retention as _retention  # noqa: F401  (forget, policy)
from cas.cli import shell as _shell  # noqa: F401  (completion)
from cas.cli import status as _status  # noqa: F401  (status)
from cas.cli import store as _store  # noqa: F401  (init)
from cas.cli import sync as _sync  # noqa: F401  (push, pull, archive)
from cas.cli import ui as _ui  # noqa: F401  (ui)
from cas.cli.app import cli, main

__all__ = ["cli", "main"]
