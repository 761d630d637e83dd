"""Processes the liveness tests kill: a slow writer, a slow GC and a writer mid-commit.

``python -m tests.liveness_workers ROLE STORE [ARGS] [--elsewhere]``; each prints one line when
it reached the point the test waits for, then works on until it finishes or is killed.
``--elsewhere`` makes the process report another host name in its leases and locks, so that
GC cannot see that it died and must wait for its lease or lock to lapse, as with a remote host.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import cas
from cas.blobstore.base import BlobStore, Payload
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.retention.gc import GCSettings
from tests.gc_workers import state

ELSEWHERE = "elsewhere.example"


class SlowChunkWrites(BlobStoreWrapper):
    """A slow disk or link: the chunk writes after the first ``after`` each wait ``delay``."""

    def __init__(self, inner: BlobStore, delay: float, after: int = 0) -> None:
        super().__init__(inner)
        self.delay = delay
        self.after = after
        self.writes = 0
        self._lock = threading.Lock()
        self.waiting = threading.Event()

    def _wait(self, key: str) -> None:
        if key.startswith("chunks/"):
            with self._lock:
                self.writes += 1
                slow = self.writes > self.after
            if slow:
                self.waiting.set()
                time.sleep(self.delay)

    def put(self, key: str, data: Payload) -> None:
        self._wait(key)
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: Payload) -> bool:
        self._wait(key)
        return self.inner.put_if_absent(key, data)


class SlowSerialDeletes(BlobStoreWrapper):
    """GC on a slow link, one delete at a time, each taking ``delay``."""

    def __init__(self, inner: BlobStore, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay
        self._lock = threading.Lock()
        self.started = threading.Event()

    def delete(self, key: str) -> None:
        with self._lock:
            self.started.set()
            time.sleep(self.delay)
            self.inner.delete(key)


def _announce(event: threading.Event, line: str) -> None:
    def wait_then_print() -> None:
        event.wait()
        print(line, flush=True)

    threading.Thread(target=wait_then_print, daemon=True).start()


def main(argv: list[str]) -> None:
    """Run one role until done (or killed)."""
    if "--elsewhere" in argv:
        argv.remove("--elsewhere")
        socket.gethostname = lambda: ELSEWHERE
    role, store = argv[0], argv[1]
    repo = (
        cas.open(store, create=False)
        if "://" in store
        else cas.open(store, create=False, fsync=False)
    )
    if role == "save":  # a save whose chunk writes stall: ``saving`` once one waits
        slow = SlowChunkWrites(repo.blobs, float(argv[3]), after=1)
        _announce(slow.waiting, "saving")
        cas.Repository(slow, repo.config).save(state(11, 12), argv[2])
        print("saved", flush=True)
    elif role == "gc":  # a GC deleting slowly: ``sweeping`` once it deletes
        deletes = SlowSerialDeletes(repo.blobs, float(argv[2]))
        _announce(deletes.started, "sweeping")
        cas.Repository(deletes, repo.config).plan_gc(GCSettings(grace=0, reflog_window=0)).execute()
        print("done", flush=True)
    elif role == "hold-lease":  # a writer with its lease taken: ``held``, until stdin closes
        with repo.lease("save"):
            print("held", flush=True)
            sys.stdin.read()
    elif role == "hold-both":  # a writer's lease and GC's lock held: ``held``, until stdin closes
        with repo.lease("save"), repo.maintenance.lock("gc"):
            print("held", flush=True)
            sys.stdin.read()
    elif role == "declare":  # a writer about to move a ref: ``declared``, then it waits
        with repo.lease("save"):
            repo.leases.declare(argv[2])
            print("declared", flush=True)
            time.sleep(120)


if __name__ == "__main__":
    main(sys.argv[1:])
