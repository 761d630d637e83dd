"""The Repository's ref operations: read refs, move them through the one door, logs and leases.

``RefOperations`` is a base class of ``Repository``. The layers above ``cas.repo`` (fs, training,
cli) read and move refs, append to logs, hold writer leases and inspect the maintenance lock
through these named methods only, never through the stores behind them, so every ref move is a
``RefStore.update`` and every one is fenced by the writer's lease.

Every write that points a ref at a checkpoint (``save``, ``put_path``, ``commit``, ``cp``,
``set_ref``, ``update_ref``, and so ``cas://`` writes, the training integrations and imports)
passes ``_guarded`` on its way to that door: a gate, a ``best`` pointer or a ref the stored
policy protects that already names another checkpoint moves only with ``overwrite=True``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from cas.digest import Digest, parse_digest
from cas.errors import InvalidName, NotFound, ProtectedRef
from cas.names import RefName, parse_ref_name
from cas.refs import damage
from cas.refs.keys import ref_key
from cas.refs.leases import LeaseManager, WriterLease, leased
from cas.refs.listing import RefListing, list_refs
from cas.refs.log import AppendLog
from cas.refs.maintenance import LeaseStatus, LockHolder, MaintenanceService
from cas.refs.records import RefEvent, RefRecord
from cas.refs.store import UPDATE_ATTEMPTS, RefChange, RefStore, UpdateFn, pointing
from cas.refs.stores import Stores

_ANY: Any = ...


class RefOperations:
    """Refs, append logs, writer leases and the maintenance lock of a Repository."""

    refs_store: RefStore
    leases: LeaseManager
    maintenance: MaintenanceService
    stores: Stores
    clock: Callable[[], float]
    ref_protection: Callable[[str], str | None]
    """``HousekeepingOperations.ref_protection``: why replacing a ref needs ``overwrite``."""

    # -- reading refs --------------------------------------------------------------------------

    def resolve(self, spec: str) -> Digest:
        """A ref name, ``name~N`` (N versions back), or a manifest digest -> manifest digest."""
        if len(spec) == 64 and all(c in "0123456789abcdef" for c in spec):
            return parse_digest(spec)
        name, _, back = spec.partition("~")
        record = self.refs_store.get(name)
        if not back:
            return record.target
        if not back.isdigit():
            raise InvalidName(f"bad ref spec {spec!r}: use NAME~N with N a number")
        event = self.refs_store.event(record, int(back))
        if event is None:
            raise NotFound(f"ref {name!r} has only {record.depth} versions in its history")
        return event.target

    def find_ref(self, name: str) -> RefRecord | None:
        """The ref's current record (target, recent history), or None when there is no such ref."""
        return self.refs_store.try_get(name)

    def ref_names(self, selector: str = "") -> list[RefName]:
        """Names of the refs a prefix, exact name or glob selects, sorted; no record is read."""
        return list(self.refs_store.names(selector))

    def refs(self, prefix: str = "") -> list[RefRecord]:
        """Refs selected by prefix, exact name or glob (``runs/r1/**``), sorted by name."""
        return self.refs_store.records(prefix)

    def list_refs(self, selector: str = "") -> RefListing:
        """Every ref ``selector`` picks that can be read, and each one that cannot, with why:
        for listings that must not let one damaged ref hide the rest."""
        return list_refs(self.refs_store, selector)

    def local_ref_change(self) -> int:
        """A number that changes whenever this process creates, moves or removes a ref of this
        store (``RefStore.local_change``): for caches of refs to drop what it changed at once."""
        return self.refs_store.local_change()

    def ref_events(self, ref: str | RefRecord) -> Iterator[RefEvent]:
        """The ref's whole history, newest first, read lazily (sealed segments only if reached)."""
        record = ref if isinstance(ref, RefRecord) else self.refs_store.get(ref)
        return self.refs_store.events(record)

    def log(self, ref: str, limit: int | None = None) -> list[RefEvent]:
        """The ref's history, newest first (the newest ``limit`` events if given)."""
        return list(itertools.islice(self.ref_events(ref), limit))

    # -- moving refs ---------------------------------------------------------------------------

    @leased
    def update_ref(
        self,
        name: str,
        fn: UpdateFn,
        *,
        op: str,
        message: str = "",
        attempts: int = UPDATE_ATTEMPTS,
        overwrite: bool = False,
    ) -> RefRecord | None:
        """Move a ref by compare-and-swap to what ``fn(current record or None)`` returns: a
        manifest digest, ``RefChange.DELETE`` or ``RefChange.KEEP`` (``cas.refs.store``).

        On a lost race ``fn`` is called again with the winner's record, up to ``attempts``
        times, then RefConflict. ``fn`` may store manifests (``put_manifest``) and may raise to
        abort. Runs under a writer lease, checked right before each write, so GC spares what
        ``fn`` stores and a writer whose lease expired never moves the ref. Returns the record
        as the update left it (None when the ref is absent). A protected ref that names another
        checkpoint moves only with ``overwrite=True`` (ProtectedRef otherwise, see ``_guarded``).
        """
        return self.refs_store.update(
            name, self._guarded(name, fn, overwrite), op=op, message=message, attempts=attempts
        )

    def set_ref(
        self,
        name: str,
        target: Digest,
        *,
        expected: Digest | Any | None = _ANY,
        op: str = "set",
        message: str = "",
        overwrite: bool = False,
    ) -> RefRecord:
        """Point ``name`` at the stored manifest ``target``; ``expected`` as in ``RefStore.set``.

        For pointers to a manifest this process just wrote (``latest``); to copy what another
        ref names, use ``cp``, which also keeps its objects safe from a concurrent GC. A
        protected ref that names another checkpoint moves only with ``overwrite=True``.
        """
        ref = parse_ref_name(name)
        record = self.update_ref(
            ref, pointing(ref, target, expected), op=op, message=message, overwrite=overwrite
        )
        assert record is not None
        return record

    def check_replaceable(self, name: str, *, overwrite: bool = False) -> None:
        """ProtectedRef now if a write to ``name`` would replace a protected ref: for writers
        to call before their chunks, so a refused save costs no I/O (the commit checks again)."""
        protection = None if overwrite else self.ref_protection(name)
        current = self.refs_store.try_get(name) if protection is not None else None
        if protection is not None and current is not None:
            raise ProtectedRef(name, protection, current.target)

    def _guarded(self, name: str, fn: UpdateFn, overwrite: bool) -> UpdateFn:
        """``fn``, refusing to replace a protected ref (``ref_protection``) that names another
        checkpoint unless ``overwrite``: ProtectedRef, and nothing moves. Checked against every
        record the compare-and-swap reads, so a protected ref created by a racing writer is not
        replaced either. Creating a ref, keeping it, pointing it where it already points and
        deleting it (an explicit ``rm``) pass."""
        protection = None if overwrite else self.ref_protection(name)
        if protection is None:
            return fn

        def guarded(current: RefRecord | None) -> Digest | RefChange:
            decision = fn(current)
            if current is None or isinstance(decision, RefChange) or decision == current.target:
                return decision
            raise ProtectedRef(name, protection, current.target)

        return guarded

    def rm(self, ref: str, *, expected: Digest | None = None) -> Digest:
        """Delete a ref (its chunks stay until GC finds them unreachable); return its target.

        ``expected``: RefConflict unless the ref still points there.
        """
        self.stores.check_deletes(f"rm {ref}")
        return self.refs_store.delete(ref, expected=expected).target

    def rm_damaged(self, ref: str) -> bool:
        """Delete a ref whose record cannot be read, whatever its blob holds; False when there
        is no such blob. A record that changed since it was read is left (PreconditionFailed)."""
        self.stores.check_deletes(f"rm {ref}")
        raw = damage.read_raw(self.refs_store, ref_key(parse_ref_name(ref)))
        if raw is None:
            return False
        damage.remove(self.refs_store, raw)
        return True

    # -- append logs ---------------------------------------------------------------------------

    def append_log(self, ref: str, kind: str) -> AppendLog:
        """The append-only log of ``kind`` under ``ref`` (``cas.refs.log``); read it, or append
        records by compare-and-swap under a writer lease."""
        return AppendLog(self.refs_store, ref, kind)

    # -- leases and maintenance ----------------------------------------------------------------

    def lease(self, purpose: str = "write") -> AbstractContextManager[WriterLease | None]:
        """Hold a writer lease for a block of writes, so GC spares what they store until the
        block's ref moves (re-entrant; None inside when leases are disabled)."""
        return self.leases.hold(purpose)

    def writer_lease(self, purpose: str) -> WriterLease | None:
        """Acquire a writer lease owned by the caller, for writes that outlive one call (a file
        open for writing); None when the store disables leases. The caller refreshes, checks
        and releases it, and commits inside ``committing_under(lease)``."""
        return self.leases.acquire(purpose)

    def committing_under(self, lease: WriterLease | None) -> AbstractContextManager[None]:
        """Run a block's ref moves under a lease from ``writer_lease``: each declares its ref in
        that lease first, so GC can fence a writer paused past it, and settles against GC's
        sweeps, as a save's commit does (docs/gc.md, "Fenced commits")."""
        return self.leases.using(lease)

    def writer_leases(self, now: float | None = None) -> list[LeaseStatus]:
        """Every writer lease in the store, and whether GC still honours it at ``now``."""
        return self.maintenance.lease_states(now)

    def maintenance_lock_holder(self) -> LockHolder | None:
        """Who holds the store's maintenance lock (``cas forget``/``cas gc``), if anyone."""
        return self.maintenance.lock_holder()

    def break_maintenance_lock(self) -> bool:
        """Remove the maintenance lock whoever holds it (a dead run's); True if there was one."""
        return self.maintenance.break_lock()
