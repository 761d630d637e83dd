"""Liveness of the process behind a lease, lock or sweep window: known dead only on its own host."""

from __future__ import annotations

import os
import socket


def process_gone(host: str, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` is known to be dead: it ran on this host (same host
    name) and no such process exists. A process elsewhere is never known dead; its record must
    expire instead."""
    if pid <= 0 or host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    return False
