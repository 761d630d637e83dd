"""Background work at a low priority: the training loop keeps the cores it uses."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

__all__ = ["lower_thread_priority"]


def lower_thread_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux; elsewhere a no-op).

    On Linux nice is per thread and threads inherit it, so the chunk workers this thread starts
    run at the same low priority. Training uses every core through its intra-op threads; a
    background save at normal priority preempts one of them and stalls each parallel region at
    its barrier, costing far more than the save's own CPU time. At low priority it runs in the
    gaps instead.
    """
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + increment))
