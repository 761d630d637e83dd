"""A run's remote tier: saves drain to a remote store in the background, each tier keeps its own
retention, and a resume takes the newest checkpoint either tier holds.

``CheckpointManager(repo, remote=..., remote_policy=...)`` builds a ``RemoteTier``. Each save
commits locally as before and wakes the drain thread, which pushes what the remote lacks
(``Repository.drain_to``, ``cas.sync.drain``): the checkpoint ref, then ``latest``, then ``best``
and gates. The loop never waits for the remote; what is queued is derived from the refs (local
checkpoint refs the remote does not hold), so a run restarted after a crash finishes the drain its
predecessor left. Checkpoints the remote policy would not keep are passed over for the remote,
never the newest one: pushed, each would be removed right after, and one the local tier keeps
longer would go up again after each removal. So when the remote falls behind, only what its
policy keeps queues up; past ``max_pending`` waiting saves the log says so.

Which checkpoints the remote policy keeps is decided by planning it over the local store: the
pending checkpoints are all there, and a remote holding older checkpoints besides only ever makes
it keep fewer of them, so the answer errs on the side of keeping.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from cas.digest import Digest
from cas.errors import BackendError, CASError, NotFound
from cas.repo.repository import KeptObjects, Repository
from cas.retention.policy import RetentionPolicy
from cas.sync.drain import TIERS_SECTION, PendingCheckpoint, TierLag
from cas.training.drain_worker import (
    InProcessRemote,
    RemoteOperations,
    WorkerRemote,
    worker_eligible,
)
from cas.training.priority import drain_cpus, lower_thread_priority, pin_thread
from cas.training.run_names import Layout
from cas.training.tier_resume import Newer, RemoteResume

if TYPE_CHECKING:
    from cas.retention.plan import ForgetPlan, ForgetResult

log = logging.getLogger("cas.training.tiers")

__all__ = ["RemoteTier", "TierLag", "open_remote", "run_selectors"]

CLOSE_WAIT = 60.0
"""Seconds ``CheckpointManager.close`` waits for the drain to catch up (it stops at a failure)."""
WAITS_FOR_REMOTE = "not yet on the remote, whose policy keeps it"
"""The reason a local ``forget`` keeps a checkpoint it would otherwise remove."""


def open_remote(remote: Repository | str) -> Repository:
    """The remote store: a Repository as given, or one opened (created if new) from a URL."""
    if isinstance(remote, Repository):
        return remote
    from cas.repo.opening import open as open_store

    return open_store(remote)


def record_remote(local: Repository, url: str, checkpoints: str) -> None:
    """Note in the local store's config which remote its ``checkpoints`` drain to, so ``cas
    status`` reports both tiers (``TIERS_SECTION``: ``{"remote": url, "checkpoints": [...]}``)."""
    section = local.config.extra.get(TIERS_SECTION)
    current = section if isinstance(section, dict) else {}
    globs = [g for g in current.get("checkpoints", []) if isinstance(g, str)]
    if current.get("remote") == url and checkpoints in globs:
        return
    if current.get("remote") != url:
        globs = []
    local.update_config(TIERS_SECTION, {"remote": url, "checkpoints": [*globs, checkpoints]})


@contextlib.contextmanager
def explain_full_disk(tier: RemoteTier | None) -> Iterator[None]:
    """A save that finds the local disk full says so in one line, with what waits for the
    remote (whose policy keeps it here until it is there) and why the remote is behind."""
    try:
        yield
    except BackendError as e:
        if tier is None or "No space left" not in str(e):
            raise
        lag = tier.lag()
        why = f" (last drain error: {lag.error})" if lag.error else ""
        raise BackendError(
            f"{e}; the local tier is full while {lag.saves} checkpoints wait for the remote "
            f"{tier.url}{why}"
        ) from e


def run_selectors(layout: Layout, run: str, phase: int = 1) -> tuple[str, str, list[str]]:
    """Globs of a run's checkpoint refs, its ``latest`` ref (of ``phase``, for a per-phase
    ``latest``), and of the refs that follow them (best, gates, the training history)."""
    checkpoint = re.sub(r"\{step[^}]*\}", "*", layout.checkpoint)
    checkpoints = checkpoint.format(run=run, phase="*")
    best = layout.best.format(run=run, phase="*")
    gates = layout.gate.format(run=run, phase="*", name="*")
    history = layout.history.format(run=run)
    return checkpoints, layout.latest.format(run=run, phase=phase), [best, gates, history]


class RemoteTier(RemoteResume):
    """The background drain of one run into a remote store, and the local policy's guard."""

    def __init__(
        self,
        local: Repository,
        remote: Repository | str,
        *,
        checkpoints: str,
        latest: str,
        pointers: Sequence[str] = (),
        policy: RetentionPolicy | None = None,
        max_pending: int = 8,
        jobs: int = 16,
        nice: int = 10,
        retry: float = 2.0,
        max_retry: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.local = local
        self._remote: Repository | None = remote if isinstance(remote, Repository) else None
        self._reader: Repository | None = None
        self._adopting: Newer | None = None
        """A checkpoint a resume loaded from the remote, for the local tier (``settle``)."""
        self._kept: KeptObjects | None = None
        """What that resume read from the remote, for the pull that adopts it."""
        self._remote_url = remote.url if isinstance(remote, Repository) else remote
        self._opening = threading.Lock()
        self.checkpoints = checkpoints
        self.latest = latest
        self.pointers = list(pointers)
        self.policy = policy
        self.max_pending = max_pending
        self.jobs = jobs
        self.clock = clock
        self._nice = nice
        self.retry = retry
        """Seconds before the first retry of a failed drain; doubled per failure."""
        self.max_retry = max_retry
        self._cond = threading.Condition()
        self._wanted = True  # a cycle is due: the first one finishes a predecessor's drain
        self._busy = False
        self._stopping = False
        self._scanned = False
        self._pending: dict[str, tuple[float, int]] = {}
        """ref -> (saved at, bytes) of the checkpoints the remote lacks, as last seen."""
        self._skipped: set[str] = set()
        self._remove_after: set[str] = set()
        self._sequence = 0
        self._notified: dict[str, int] = {}
        """ref -> the sequence number of its latest ``notify``: a scan that began before it
        cannot have seen it."""
        self._error: str | None = None
        self._passed: dict[str, Digest] = {}
        """ref -> target of the checkpoints passed over for the remote (its policy would not keep
        them): a later cycle neither asks the remote for them nor plans them again, until a
        pointer moves (``wake``: a gate may now protect one)."""
        self._replan = False
        self._latest_of: dict[str, str] = {}
        """ref -> the ``latest`` its save moved (the save's phase's), for its drain."""
        self._there: dict[str, Digest] = {}
        """ref -> target of the checkpoints this process drained or found on the remote: a
        later cycle does not ask for them again (``pending_on``'s ``present``)."""
        self._pushed: dict[str, Digest | None] | None = None
        """The local targets of ``latest`` and the pointers when they were last pushed whole:
        a cycle with no checkpoint to drain moves them only if one has moved since."""
        self._known: frozenset[Digest] | None = None
        """The chunks of the checkpoint drained last: the remote held them a moment ago, so the
        next drain asks for none of them (a checkpoint shares most chunks with the one before)
        and sends the others without asking either (``transfer``'s ``known``)."""
        self.drained = 0
        """Checkpoints this process pushed to the remote."""
        self.sent_bytes = 0
        """Stored bytes this process's drain wrote to the remote (chunks and manifests)."""
        self._cpus = drain_cpus()
        """Where the drain runs (``CAS_DRAIN_CPUS``); a bad value fails here, in one line."""
        self._ops: RemoteOperations = (
            WorkerRemote(local.url, remote)
            if isinstance(remote, str) and worker_eligible(local, remote)
            else InProcessRemote(local, lambda: self.remote)
        )
        """Where the drain's requests are made: a worker process where the stores allow it
        (``cas.training.drain_worker``: the loop keeps the interpreter's lock), else here."""
        record_remote(local, self.url, checkpoints)
        self._thread = threading.Thread(target=self._run, name="cas-drain", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the remote tier is."""
        return self._remote_url

    @property
    def remote(self) -> Repository:
        """The remote store in this process, opened on first use: by a resume, or by the drain
        thread when it makes the requests itself (the worker opens its own), so a remote that is
        down when the run starts delays nothing but the drain."""
        with self._opening:
            if self._remote is None:
                self._remote = open_remote(self._remote_url)
            return self._remote

    def _has_work(self) -> bool:
        """Whether the local store holds anything of the run to drain: a new node's does not,
        and then the drain neither opens the remote nor takes a lease there (a resume from the
        remote would otherwise share the CPU and the link with it)."""
        selectors = [self.checkpoints, *self.pointers]
        return any(self.local.ref_names(selector) for selector in selectors)

    @classmethod
    def of_run(
        cls,
        local: Repository,
        remote: Repository | str | None,
        layout: Layout,
        run: str,
        phase: int,
        policy: RetentionPolicy | None,
        max_pending: int,
        retry: float = 2.0,
    ) -> RemoteTier | None:
        """``CheckpointManager``'s tier: None without a ``remote``, else ``for_run``."""
        if remote is None:
            return None
        return cls.for_run(
            local, remote, layout, run, policy=policy, max_pending=max_pending, phase=phase,
            retry=retry,
        )  # fmt: skip

    @classmethod
    def for_run(
        cls,
        local: Repository,
        remote: Repository | str,
        layout: Layout,
        run: str,
        *,
        policy: RetentionPolicy | None,
        max_pending: int,
        phase: int = 1,
        retry: float = 2.0,
    ) -> RemoteTier:
        """The remote tier of the run ``run`` (its ``runs/<id>`` prefix) under ``layout``;
        ``retry``: seconds before a failed drain is tried again (doubled per failure, to 60 s
        or ``retry`` if that is longer)."""
        checkpoints, latest, pointers = run_selectors(layout, run, phase)
        return cls(
            local, remote, checkpoints=checkpoints, latest=latest, pointers=pointers,
            policy=policy, max_pending=max_pending, retry=retry, max_retry=max(60.0, retry),
        )  # fmt: skip

    def notify(
        self, ref: str, saved_at: float, new_bytes: int, latest: str | None = None
    ) -> TierLag:
        """A save committed ``ref`` locally and moved ``latest`` to it (a per-phase ``latest``
        names the save's phase): queue it for the remote; the lag, this save included."""
        with self._cond:
            if latest is not None:
                self._latest_of[ref] = latest
                self.latest = latest  # the run's phase now: a resume looks here too
            self._pending[ref] = (saved_at, new_bytes)
            self._sequence += 1
            self._notified[ref] = self._sequence
            self._skipped.discard(ref)
            self._wanted = True
            self._cond.notify_all()
            lag = self._lag_locked()
        if lag.saves > 1:
            log.info(
                "remote tier %s: %d saves (%d bytes) not yet there, the oldest %.1fs ago%s",
                self.url, lag.saves, lag.bytes, lag.age(self.clock()),
                f"; last error: {lag.error}" if lag.error else "",
            )  # fmt: skip
        return lag

    def wake(self) -> None:
        """Run a drain cycle soon (a gate or ``best`` moved without a save)."""
        with self._cond:
            self._replan = True  # a gate may protect a checkpoint passed over so far
            self._wanted = True
            self._cond.notify_all()

    def lag(self) -> TierLag:
        """What the remote lacks, as this process last saw it (no request is made)."""
        with self._cond:
            return self._lag_locked()

    def _lag_locked(self) -> TierLag:
        waiting = [v for r, v in self._pending.items() if r not in self._skipped]
        oldest = min((saved for saved, _ in waiting), default=None)
        return TierLag(
            len(waiting), sum(b for _, b in waiting), oldest, len(self._skipped), self._error
        )

    @property
    def idle(self) -> bool:
        """Whether no drain cycle is due or running now (a save's ``notify`` makes one due);
        unlike ``wait``, asking starts no cycle."""
        with self._cond:
            return not (self._wanted or self._busy)

    def wait(self, timeout: float | None = None) -> TierLag:
        """Wait until the remote holds every checkpoint due there (or ``timeout`` passes, or a
        drain attempt fails); the lag then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._stopping:
                return self._lag_locked()
            self._wanted = True
            self._cond.notify_all()
            while self._wanted or self._busy:
                if self._error is not None and not self._busy:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left if left is not None else 1.0)
            return self._lag_locked()

    def close(self, timeout: float | None = 0.0) -> TierLag:
        """Stop the drain thread, after waiting up to ``timeout`` for it to catch up; the lag
        left (a later run with the same stores finishes it)."""
        lag = self.wait(timeout) if timeout != 0.0 else self.lag()
        with self._cond:
            if self._stopping:
                return lag
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._ops.close()
        with self._opening:
            reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(CASError, OSError):
                reader.close()  # the read-only handle a resume opened: its connections
        if lag.saves:
            log.warning(
                "remote tier %s: %d saves (%d bytes) not drained; the next run with this store "
                "and remote pushes them", self.url, lag.saves, lag.bytes,
            )  # fmt: skip
        return lag

    def _run(self) -> None:
        lower_thread_priority(self._nice)  # transfer's copy threads inherit it
        pin_thread(self._cpus)  # and so do they this, and a worker process started from here
        delay = self.retry
        while True:
            with self._cond:
                while not self._wanted and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._wanted = False
                self._busy = True
            failed = False
            try:
                self._cycle()
            except Exception as e:  # the remote is down or refused: try again later
                failed = True
                with self._cond:
                    self._error = f"{type(e).__name__}: {e}"
                log.warning("remote tier %s: drain failed, retrying in %.0fs: %s",
                            self.url, delay, e)  # fmt: skip
            with self._cond:
                self._busy = False
                if not failed:
                    self._error = None
                    delay = self.retry
                self._cond.notify_all()
                if failed:
                    self._cond.wait_for(lambda: self._stopping, delay)
                    delay = min(self.max_retry, delay * 2)
                    self._wanted = True

    def _cycle(self) -> None:
        with self._cond:
            began = self._sequence
        if self._remote is None and not self._has_work():
            return
        with self._cond:
            replan, self._replan = self._replan, False
        if replan:
            self._passed.clear()
        pending = self._ops.pending(self.checkpoints, self._passed, self._there)
        skip = self._thin(pending)
        self._remember(pending, skip, began)
        todo = [p for p in pending if p.ref not in skip]
        for i, item in enumerate(todo):
            with self._cond:
                if self._stopping:
                    return
            hold = {p.target for p in todo[i + 1 :]}
            known, self._known = self._known, None  # unknown again until this drain succeeds
            sent = 0
            pointed = self._pointer_targets() if not hold else None
            try:
                with self._cond:
                    latest = self._latest_of.get(item.ref, self.latest)
                # The chunks of what it pushed come back with it (the transfer's own list): the
                # training process decodes no manifest for them, which was most of the tier's CPU
                # per save (docs/training.md).
                sent, self._known = self._ops.drain(
                    item.ref, latest=latest, pointers=self.pointers, hold_back=hold,
                    jobs=self.jobs, known=known,
                )  # fmt: skip
                self._there[item.ref] = item.target
                if pointed is not None:
                    self._pushed = pointed
            except NotFound:
                now = self.local.find_ref(item.ref)
                if now is not None and now.target == item.target:
                    raise
                # The local policy removed it meanwhile, which it does only to checkpoints the
                # remote policy does not keep; a re-save replaced it: the next cycle has it.
            with self._cond:
                self._pending.pop(item.ref, None)
                self._latest_of.pop(item.ref, None)
                self.drained += 1
                self.sent_bytes += sent
                remove = item.ref in self._remove_after
                self._remove_after.discard(item.ref)
            if remove:
                with contextlib.suppress(NotFound):
                    self.local.rm(item.ref, expected=item.target)
        if not todo:  # a gate or best may have moved alone
            pointed = self._pointer_targets()
            if pointed != self._pushed:
                self._ops.drain(None, latest=self.latest, pointers=self.pointers)
                self._pushed = pointed
        if todo and self.policy is not None:
            try:
                removed = self._ops.forget(self.policy)
                for ref in removed:  # no longer there: the next scan finds it passed over
                    self._there.pop(ref, None)
            except CASError as e:  # a GC holds the remote's maintenance lock: next time
                log.warning("remote tier %s: its policy did not run: %s", self.url, e)

    def _pointer_targets(self) -> dict[str, Digest | None]:
        """The local targets of ``latest`` and of every ref the pointers name, read now."""
        with self._cond:
            latest = self.latest
        names = {latest, *(n for selector in self.pointers for n in self.local.ref_names(selector))}
        found = {name: self.local.find_ref(name) for name in sorted(names)}
        return {name: record.target if record else None for name, record in found.items()}

    def _thin(self, pending: list[PendingCheckpoint]) -> set[str]:
        """Checkpoints to pass over for the remote: those the remote policy would not keep,
        never the newest. Pushed, each would be removed by that policy right after; and one
        the local tier keeps longer than the remote would otherwise go up again after every
        removal (a drain cycle per save pushing each such checkpoint once more)."""
        if not pending or self.policy is None:
            return set()
        latest = self.local.find_ref(self.latest)
        newest = latest.target if latest is not None else pending[-1].target
        undecided = [
            p for p in pending if p.target != newest and self._passed.get(p.ref) != p.target
        ]
        if undecided:  # a plan reads every local checkpoint: only when there is news
            dropped = {d.ref for d in self.local.plan_forget(self.policy).dropped}
            self._passed.update({p.ref: p.target for p in undecided if p.ref in dropped})
        skip = {p.ref for p in pending if self._passed.get(p.ref) == p.target != newest}
        if skip and len(pending) > self.max_pending:
            log.warning(
                "remote tier %s: %d saves behind; passing over %d the remote policy would not "
                "keep", self.url, len(pending), len(skip),
            )  # fmt: skip
        return skip

    def _remember(self, pending: list[PendingCheckpoint], skip: set[str], began: int) -> None:
        """Record the scan: inherited checkpoints get their saved-at and full size."""
        with self._cond:
            known = dict(self._pending)
        fresh: dict[str, tuple[float, int]] = {}
        for item in pending:
            if item.ref in known:
                fresh[item.ref] = known[item.ref]
                continue
            try:
                manifest = self.local.manifest(item.target)
                saved = manifest.meta.get("saved_at", manifest.created_at)
                fresh[item.ref] = (float(saved), manifest.logical_bytes())
            except CASError:
                fresh[item.ref] = (item.changed_at, 0)
        with self._cond:
            # Saves notified since the scan began may be missing from it: keep them.
            for ref, value in self._pending.items():
                if self._notified.get(ref, 0) > began:
                    fresh.setdefault(ref, value)
            self._pending = fresh
            self._skipped = skip & set(fresh)
            self._latest_of = {r: v for r, v in self._latest_of.items() if r in fresh}
            self._scanned = True
        self._passed = {r: t for r, t in self._passed.items() if r in fresh}

    def guard(self, plan: ForgetPlan) -> ForgetPlan:
        """``plan`` with the checkpoints it drops that the remote policy keeps and the remote
        lacks turned into keeps (invariant 14). Makes no remote request: until the drain has
        read the remote once, every checkpoint of the run counts as not there yet."""
        if not plan.dropped:
            return plan
        held = self.needed({d.ref for d in plan.dropped})
        decisions = tuple(
            replace(d, keep=True, reasons=(*d.reasons, WAITS_FOR_REMOTE))
            if not d.keep and d.ref in held
            else d
            for d in plan.decisions
        )
        return replace(plan, decisions=decisions)

    def needed(self, refs: set[str]) -> set[str]:
        """Those of ``refs`` the remote still needs: not there yet, and kept by its policy.
        Makes no remote request: until the drain has read the remote once, every checkpoint
        of the run counts as not there yet."""
        with self._cond:
            scanned, pending = self._scanned, set(self._pending)
        waiting = refs & (pending if scanned else set(self.local.ref_names(self.checkpoints)))
        if not waiting or self.policy is None:
            return waiting
        return waiting & {d.ref for d in self.local.plan_forget(self.policy).kept}

    def remove_after_drain(self, ref: str) -> bool:
        """Remove the local ``ref`` now, or, if the remote still needs it, once it is there
        (an integration's own pruning, e.g. Lightning's ``save_top_k``); whether it waits."""
        if not self.needed({ref}):
            return False
        with self._cond:
            self._remove_after.add(ref)
        return True

    def apply_local_policy(self, policy: RetentionPolicy) -> ForgetResult:
        """``Repository.forget(policy)`` on the local store, sparing what ``guard`` spares."""
        self.local.take_snapshots(policy)
        return self.guard(self.local.plan_forget(policy)).execute()
