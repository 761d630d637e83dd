"""The remote tier's requests, made by a process of their own (``-m cas.training.drain_worker``).

A drain spends its CPU in Python: botocore builds, signs and parses every request. In a thread of
the training process that work takes the interpreter's lock from the loop, which needs it between
its kernels. Measured with ``scripts/bench_tiers.py``'s loop on one intra-op thread, leaving a
core free as a loop that waits on a GPU does (docs/training.md, "Two tiers"): a save with the
remote tier cost the loop 141-151 ms with a drain thread, 96-99 ms with this worker, 22-23 ms
with no remote. On a loop that keeps every core busy the drain's CPU is the cost either way
(240-308 ms with the worker, 263-340 ms with the thread). So where it can, ``RemoteTier`` keeps
its bookkeeping (what is pending, what the local policy must spare) in the training process and
sends the requests here; the other way is ``InProcessRemote``, the same three calls made in the
caller's thread (a remote given as a Repository, an encrypted or in-memory local store, a clock
of the caller's own, or ``CAS_DRAIN=thread``).

The worker opens both stores itself, from their URLs, and serves one request at a time over a
pipe (msgpack frames): ``pending``, ``drain`` and ``forget``. It exits when the pipe closes, so
it never outlives the training process by more than the request in hand; one killed or crashed
is started again at the next drain cycle and, the drain keeping no state of its own
(``cas.sync.drain``), loses nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, Protocol

import msgpack

from cas import errors
from cas.digest import Digest
from cas.errors import BackendError, CASError
from cas.repo.keys import ENCRYPTION_SECTION
from cas.repo.opening import open as open_store
from cas.repo.repository import Repository
from cas.retention.policy import RetentionPolicy
from cas.sync.drain import PendingCheckpoint
from cas.training.priority import lower_thread_priority

__all__ = [
    "COMMAND",
    "Drained",
    "InProcessRemote",
    "RemoteOperations",
    "WorkerRemote",
    "worker_eligible",
]

COMMAND = [sys.executable, "-m", "cas.training.drain_worker"]
"""How a worker is started (a test wraps it to inject faults into the worker's requests)."""
WORKER_NICE = 0
"""The worker's priority. Measured on ``scripts/bench_tiers.py``'s loop (docs/training.md): at
nice 5 or 10 the worker, a process of its own, loses the CPU to a loop that keeps every core busy
and drains over hundreds of steps, costing that loop more per save than at normal priority."""
ENV_MODE = "CAS_DRAIN"
"""``process`` (the default where the stores allow it) or ``thread``."""


class Drained(NamedTuple):
    """What one drain call did: the bytes it sent, and the chunks of the checkpoint it pushed,
    there on the remote now (the next drain's ``known``); None where it pushed none."""

    sent: int
    chunks: frozenset[Digest] | None


class RemoteOperations(Protocol):
    """What a drain cycle asks of the remote: the three calls ``RemoteTier`` makes."""

    def pending(
        self, selector: str, absent: Mapping[str, Digest], present: MutableMapping[str, Digest]
    ) -> list[PendingCheckpoint]: ...

    def drain(
        self,
        ref: str | None,
        *,
        latest: str,
        pointers: Sequence[str],
        hold_back: Collection[Digest] = (),
        jobs: int = 16,
        known: Collection[Digest] | None = None,
    ) -> Drained: ...

    def forget(self, policy: RetentionPolicy) -> list[str]: ...

    def close(self) -> None: ...


class InProcessRemote:
    """The remote's calls made in the caller's thread, on ``local`` and ``remote()``."""

    def __init__(self, local: Repository, remote: Callable[[], Repository]) -> None:
        self.local = local
        self._remote = remote  # the remote store is opened on first use

    def pending(
        self, selector: str, absent: Mapping[str, Digest], present: MutableMapping[str, Digest]
    ) -> list[PendingCheckpoint]:
        return self.local.pending_on(self._remote(), selector, absent, present)

    def drain(
        self,
        ref: str | None,
        *,
        latest: str,
        pointers: Sequence[str],
        hold_back: Collection[Digest] = (),
        jobs: int = 16,
        known: Collection[Digest] | None = None,
    ) -> Drained:
        report = self.local.drain_to(
            self._remote(), ref, latest=latest, pointers=pointers, hold_back=hold_back,
            jobs=jobs, known=known,
        )  # fmt: skip
        moved = report.transfer
        if moved is None:
            return Drained(0, None)
        return Drained(moved.wire_bytes, moved.chunks or None)

    def forget(self, policy: RetentionPolicy) -> list[str]:
        return list(self._remote().forget(policy).removed)

    def close(self) -> None:
        pass


def worker_eligible(local: Repository, remote: Any) -> bool:
    """Whether a worker process can do ``local``'s drain to ``remote``: both stores reopen from
    their URLs alone (a remote URL, a plain local directory), and the store's clock is the
    system's. Else, or with ``CAS_DRAIN=thread``, the drain runs in a thread."""
    mode = os.environ.get(ENV_MODE, "process").strip().lower()
    if mode not in ("process", "thread"):
        raise ValueError(f"{ENV_MODE} must be 'process' or 'thread', got {mode!r}")
    local_dir = local.url.startswith("/") or local.url.startswith("file://")
    return (
        mode == "process"
        and os.name == "posix"  # the pipes are passed as inherited descriptors
        and isinstance(remote, str)
        and local_dir
        and ENCRYPTION_SECTION not in local.config.extra
        and local.clock is time.time
    )


class WorkerRemote:
    """The remote's calls made by a worker process, started on first use and again after it
    dies. One call at a time (the drain thread is the only caller)."""

    def __init__(self, local_url: str, remote_url: str, nice: int = WORKER_NICE) -> None:
        self.local_url = local_url
        # A relative path names the same store after the caller changes directory.
        self.remote_url = remote_url if "://" in remote_url else os.path.abspath(remote_url)
        self.nice = nice
        self._process: subprocess.Popen[bytes] | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None
        self._lock = threading.Lock()
        _WORKERS.add(self)

    def _forked(self) -> None:
        """In a child forked from the training process (a data loader's worker): close the
        pipe's ends there, so the worker still sees its training process end; the child's
        copy of this object no longer reaches a worker."""
        for conn in (self._send, self._receive):
            if conn is not None:
                conn.close()
        self._process = self._send = self._receive = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        try:
            self._process = subprocess.Popen(
                [*COMMAND, str(requests_r), str(replies_w)],
                pass_fds=(requests_r, replies_w),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (requests_r, requests_w, replies_r, replies_w):
                os.close(fd)
            raise
        os.close(requests_r)
        os.close(replies_w)
        self._send = Connection(requests_w, readable=False)
        self._receive = Connection(replies_r, writable=False)
        try:
            self._call_started("open", self.local_url, self.remote_url, self.nice)
        except CASError:
            self._stop(kill=True)  # the next call starts another, which opens them again
            raise

    def _call_started(self, *request: Any) -> Any:
        assert self._send is not None and self._receive is not None
        try:
            self._send.send_bytes(msgpack.packb(request))
            reply = msgpack.unpackb(self._receive.recv_bytes(), strict_map_key=False)
        except (EOFError, OSError) as e:
            code = self._stop(kill=True)
            raise BackendError(f"the drain worker exited (code {code}) during {request[0]}") from e
        if reply[0] == "error":
            _, kind, message = reply
            raise _rebuilt(kind, message)
        return reply[1]

    def _call(self, *request: Any) -> Any:
        with self._lock:
            if self._process is None:
                self._start()
            return self._call_started(*request)

    def pending(
        self, selector: str, absent: Mapping[str, Digest], present: MutableMapping[str, Digest]
    ) -> list[PendingCheckpoint]:
        found, there = self._call("pending", selector, dict(absent), dict(present))
        present.update(there)
        return [PendingCheckpoint(r, Digest(t), c) for r, t, c in found]

    def drain(
        self,
        ref: str | None,
        *,
        latest: str,
        pointers: Sequence[str],
        hold_back: Collection[Digest] = (),
        jobs: int = 16,
        known: Collection[Digest] | None = None,
    ) -> Drained:
        sent, chunks = self._call(
            "drain", ref, latest, list(pointers), list(hold_back), jobs,
            None if known is None else list(known),
        )  # fmt: skip
        return Drained(sent, None if chunks is None else frozenset(map(Digest, chunks)))

    def forget(self, policy: RetentionPolicy) -> list[str]:
        removed: list[str] = self._call("forget", policy.to_dict())
        return removed

    def _stop(self, kill: bool = False) -> int | None:
        process, self._process = self._process, None
        for conn in (self._send, self._receive):
            if conn is not None:
                conn.close()
        self._send = self._receive = None
        if process is None:
            return None
        if kill:
            process.kill()
        try:
            return process.wait(30)  # the pipe closed: it exits after the request in hand
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def close(self) -> None:
        with self._lock:
            self._stop()


def _rebuilt(kind: str, message: str) -> CASError:
    """The worker's failure as the caller's: the same ``cas.errors`` class where one takes a
    message alone (``NotFound`` matters: the drain thread tells it apart), else a BackendError."""
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, CASError):
        try:
            return cls(message)
        except TypeError:
            pass
    return BackendError(f"{kind}: {message}")


_WORKERS: weakref.WeakSet[WorkerRemote] = weakref.WeakSet()


def _close_in_child() -> None:
    for worker in list(_WORKERS):
        worker._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


# -- the worker ----------------------------------------------------------------------------------


def serve(requests: Connection, replies: Connection) -> None:
    """Answer requests until the pipe closes: ``open`` first, then ``pending``, ``drain``,
    ``forget``; a failure is sent back as ``("error", class name, message)``."""
    local: Repository | None = None
    remote: Repository | None = None
    while True:
        try:
            request = msgpack.unpackb(requests.recv_bytes(), strict_map_key=False)
        except (EOFError, OSError):
            return
        try:
            op, args = request[0], request[1:]
            if op == "open":
                local_url, remote_url, nice = args
                lower_thread_priority(nice)  # this thread's, inherited by every thread after
                local = open_store(local_url, create=False)
                remote = open_store(remote_url)
                result: Any = None
            else:
                assert local is not None and remote is not None, "open comes first"
                result = _answer(local, remote, op, args)
            reply: Any = ("ok", result)
        except Exception as e:  # sent back: the drain thread raises it and retries later
            reply = ("error", type(e).__name__, str(e))
        replies.send_bytes(msgpack.packb(reply))


def _answer(local: Repository, remote: Repository, op: str, args: list[Any]) -> Any:
    """A request answered by the calls the drain thread makes when it has no worker."""
    here = InProcessRemote(local, lambda: remote)
    if op == "pending":
        selector, absent, present = args
        found = here.pending(selector, absent, present)
        return [(p.ref, p.target, p.changed_at) for p in found], present
    if op == "drain":
        ref, latest, pointers, hold_back, jobs, known = args
        drained = here.drain(
            ref, latest=latest, pointers=pointers, hold_back=hold_back, jobs=jobs,
            known=None if known is None else frozenset(known),
        )  # fmt: skip
        return drained.sent, None if drained.chunks is None else sorted(drained.chunks)
    if op == "forget":
        return here.forget(RetentionPolicy.from_dict(args[0]))
    raise ValueError(f"unknown request {op!r}")


def main(argv: list[str]) -> int:
    # A Ctrl-C or a scheduler's SIGTERM reaches the whole job: the training process saves and
    # closes the pipe, and the worker finishes what it was asked until then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requests = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)
    serve(requests, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
