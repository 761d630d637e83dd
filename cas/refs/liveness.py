"""Liveness of the process behind a lease, lock, sweep window or fence: known dead only when certain.

A record names its process by more than host name and pid: two containers can share a host name
(``docker --network host``, a Kubernetes sidecar) without sharing a PID namespace, and a pid is
reused once its process exits. So every record also carries the boot id
(``/proc/sys/kernel/random/boot_id``), the PID namespace (``/proc/self/ns/pid``) and the
process's start time (``/proc/<pid>/stat``, field 22). A process is known dead only when its host
name, boot id and PID namespace all match this process's and no process with that pid and start
time exists; anywhere else, or for a record that lacks these fields (older versions), it is never
judged by its pid and its record must run out on the storage's clock (DESIGN invariant 12,
docs/gc.md "Liveness").
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PID_NS_PATH = "/proc/self/ns/pid"


@dataclass(frozen=True)
class ProcessIdentity:
    """Who wrote a record: enough to tell, from another process, whether it certainly died."""

    host: str
    pid: int
    boot_id: str = ""
    """The kernel's boot id; ``""`` where unknown (no ``/proc``, an older record)."""
    pid_ns: str = ""
    """The PID namespace (``device:inode`` of ``/proc/self/ns/pid``); ``""`` where unknown."""
    pid_start: int = 0
    """The process's start time in clock ticks since boot; 0 where unknown."""

    def fields(self) -> dict[str, Any]:
        """The JSON fields a lease, lock or sweep record stores."""
        return {
            "host": self.host,
            "pid": self.pid,
            "boot_id": self.boot_id,
            "pid_ns": self.pid_ns,
            "pid_start": self.pid_start,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> ProcessIdentity:
        """The identity a record's fields name; missing or odd fields read as unknown."""
        return cls(
            str(doc.get("host", "")),
            _int(doc.get("pid")),
            _text(doc.get("boot_id")),
            _text(doc.get("pid_ns")),
            _int(doc.get("pid_start")),
        )

    def gone(self) -> bool:
        """Whether this process is certainly dead: same host, boot and PID namespace as the
        caller, and no process with its pid (and start time, when recorded) exists. Any doubt,
        an unknown field included, answers False: the record must expire instead."""
        me = current()
        if not (self.boot_id and self.pid_ns and me.boot_id and me.pid_ns):
            return False
        if (self.host, self.boot_id, self.pid_ns) != (me.host, me.boot_id, me.pid_ns):
            return False
        if self.pid <= 0:
            return False
        if self.pid == me.pid:
            return bool(self.pid_start) and self.pid_start != me.pid_start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # a process under another user has this pid: compare start times below
        if not self.pid_start:
            return False
        start = _start_time(self.pid)
        return start is not None and start != self.pid_start  # the pid was reused


UNKNOWN = ProcessIdentity("", 0)
"""The identity of an unreadable record: never known dead."""

_current: dict[int, ProcessIdentity] = {}


def current() -> ProcessIdentity:
    """This process's identity (worked out once per pid: a fork gets its own)."""
    pid = os.getpid()
    found = _current.get(pid)
    if found is None:
        found = _current[pid] = _identify(pid)
    return found


def process_gone(who: ProcessIdentity) -> bool:
    """Whether the process ``who`` names is certainly dead (``ProcessIdentity.gone``)."""
    return who.gone()


def _identify(pid: int) -> ProcessIdentity:
    host = socket.gethostname()
    start = _start_time(pid, "self")
    if start is None:
        # /proc is missing, or is mounted for another PID namespace than ours (its pid numbers
        # are not ours): no pid of another process can be checked with certainty.
        return ProcessIdentity(host, pid)
    try:
        with open(BOOT_ID_PATH) as f:
            boot_id = f.read().strip()
        ns = os.stat(PID_NS_PATH)
    except OSError:
        return ProcessIdentity(host, pid)
    return ProcessIdentity(host, pid, boot_id, f"{ns.st_dev}:{ns.st_ino}", start)


def _start_time(pid: int, entry: str = "") -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in ticks since boot), or None if there is
    no such process in the mounted ``/proc`` or it does not describe ``pid`` (``entry="self"``
    reads ``/proc/self``, which names another pid when ``/proc`` is another namespace's)."""
    try:
        with open(f"/proc/{entry or pid}/stat") as f:
            line = f.read()
    except OSError:
        return None
    head, _, rest = line.rpartition(")")
    fields = rest.split()
    try:
        if int(head.split("(", 1)[0]) != pid:
            return None
        return int(fields[19])  # fields[0] is field 3 (state); field 22 is starttime
    except (ValueError, IndexError):
        return None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _text(value: Any) -> str:
    return value[:200] if isinstance(value, str) else ""
