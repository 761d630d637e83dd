"""Background work at a low priority, or on CPUs of its own: the training loop keeps the cores
it uses."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Mapping

__all__ = [
    "ENV_BACKGROUND_CPUS", "ENV_CPUS", "background_cpus", "drain_cpus", "lower_thread_priority",
    "pin_thread",
]  # fmt: skip

ENV_CPUS = "CAS_DRAIN_CPUS"
"""CPUs the remote tier's drain runs on (``3`` or ``2-5,7``): its thread, the threads it starts
and its worker process. Unset, those of ``CAS_BACKGROUND_CPUS``, else every CPU the training
process may use."""

ENV_BACKGROUND_CPUS = "CAS_BACKGROUND_CPUS"
"""CPUs for all of a manager's background work: its background saves (the save thread and the
chunk workers it starts) and, unless ``CAS_DRAIN_CPUS`` names others, the remote tier's drain.
With the drain alone kept off the loop's CPU, a busy drain pushed the background saves' threads
onto it: on the benchmark's one-thread loop with a spare CPU, the tier cost 36 ms a save over a
local save's 17 ms, and 23.5 ms with the saves kept on the spare CPU too (docs/training.md)."""


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


def drain_cpus(environ: Mapping[str, str] = os.environ) -> frozenset[int] | None:
    """The CPUs ``CAS_DRAIN_CPUS`` names, else those ``CAS_BACKGROUND_CPUS`` names, or None when
    neither is set. ValueError, one line, for a list that does not parse, names a CPU this
    process may not use, or asks for pinning on a platform without it."""
    return _cpus_of(ENV_CPUS, environ) or _cpus_of(ENV_BACKGROUND_CPUS, environ)


def background_cpus(environ: Mapping[str, str] = os.environ) -> frozenset[int] | None:
    """The CPUs ``CAS_BACKGROUND_CPUS`` names, or None when it is unset (errors as
    ``drain_cpus``)."""
    return _cpus_of(ENV_BACKGROUND_CPUS, environ)


def _cpus_of(name: str, environ: Mapping[str, str]) -> frozenset[int] | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{name} is set, but this platform cannot pin threads to CPUs")
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"{name} must list CPUs as in '3' or '2-5,7', got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(
            f"{name}={text!r} names CPUs this process may not use (it may use {_ranges(allowed)})"
        )
    return frozenset(cpus)


def pin_thread(cpus: frozenset[int] | None) -> None:
    """Keep the calling thread, and the threads and processes it starts from now on, on
    ``cpus`` (Linux applies an affinity per thread, and a new thread or process takes its
    parent thread's); None leaves it where it is."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def _ranges(cpus: set[int]) -> str:
    ordered = sorted(cpus)
    runs: list[list[int]] = []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
