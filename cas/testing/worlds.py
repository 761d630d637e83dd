"""Untidy worlds for liveness tests: a process in another PID namespace, a process whose clock is off.

``in_pid_namespace(argv)`` runs a command as ``unshare --pid --fork --mount-proc`` does for a
container sharing the host name but not the PID namespace (a Kubernetes sidecar, ``docker
--network host``), and gives it a pid that no process of this namespace has, so a pid check from
here finds "no such process" for a writer that is alive. ``clock_offset_env(seconds)`` makes a
child's wall clock run ``seconds`` off through libfaketime (the storage's clock, file mtimes and
S3's, stays true). Both say why when the machine cannot do it (``*_unavailable``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

FAKETIME_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
)


def unshare_unavailable() -> str | None:
    """Why a new PID namespace cannot be made here (no ``unshare``, not permitted), or None."""
    if shutil.which("unshare") is None:
        return "util-linux `unshare` not found"
    try:
        probe = subprocess.run(
            [*_unshare(), "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare --pid --fork --mount-proc` failed: {e}"
    if probe.returncode != 0:
        return f"`unshare --pid --fork --mount-proc` is not permitted here: {probe.stderr.strip()}"
    return None


def in_pid_namespace(argv: list[str]) -> list[str]:
    """``argv`` run in a new PID namespace (with its own ``/proc``), as a pid unused here."""
    pid = free_pid()
    # Set the new namespace's last pid so that the command, forked by the shell, gets ``pid``.
    script = f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid; "$@"; exit $?'
    return [*_unshare(), "sh", "-c", script, "sh", *argv]


def free_pid() -> int:
    """A pid no process of this namespace has now (high, so none is likely to take it soon)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 100, 300, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise RuntimeError("no free pid")


def _unshare() -> list[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc"]


def faketime_library() -> str | None:
    """The libfaketime library to preload (Debian package ``faketime``), or None."""
    for path in FAKETIME_LIBRARIES:
        if os.path.exists(path):
            return path
    return None


def faketime_unavailable() -> str | None:
    """Why a child's clock cannot be skewed here, or None."""
    if faketime_library() is None:
        return "libfaketime not found (apt-get install faketime; scripts/setup.sh does as root)"
    return None


def clock_offset_env(seconds: float, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child whose wall clock is ``seconds`` off (negative: behind)."""
    library = faketime_library()
    if library is None:
        raise RuntimeError(faketime_unavailable())
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = library
    env["FAKETIME"] = f"{seconds:+g}"
    # Monotonic clocks are offset too: left true, Python's sleeps fail with EINVAL under it.
    env.pop("FAKETIME_DONT_FAKE_MONOTONIC", None)
    return env
