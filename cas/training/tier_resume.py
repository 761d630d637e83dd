"""Resuming from a run's remote tier: the reading side of ``cas.training.tiers.RemoteTier``.

On a node whose local tier lacks the run's newest checkpoint (a new node, or one the run left
before its last saves), ``restore("auto")`` loads that checkpoint straight from the remote,
reading the chunks this node holds already (a cached base model) from the local store and the
rest from the remote, and writes nothing locally before the first training step. The run's next
save first adopts the checkpoint into the local tier (pulls what the local store lacks, then
points the local ``latest`` at it), so the save's ``latest`` moves on from it as always. The
objects the load read from the remote are kept in memory until then (up to ``KEEP_BYTES``), and
that pull takes them from there: a checkpoint up to that size crosses the network once. A
checkpoint that needs more from the remote than that, and one whose read from the remote fails (a
damaged object, an encrypted store), is pulled into the local tier first and loaded from there,
where a damaged chunk is healed as on any resume: it too crosses the network once.

Every read goes through a read-only handle on the remote: a resume waits for no probe of
conditional writes and takes no lease there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cas.digest import Digest
from cas.errors import CASError, NotFound
from cas.repo.repository import KeptObjects, Repository
from cas.training.restore import Found, resume_candidates

log = logging.getLogger("cas.training.tiers")

__all__ = ["Loader", "Newer", "RemoteResume"]

KEEP_BYTES = 256 << 20
"""The most a resume from the remote keeps in memory of the objects it read there, until the
run's next save pulls the checkpoint into the local tier (without it, a 3.7 MB checkpoint's 15
chunks were read twice). A checkpoint needing more from the remote is pulled first."""

Loader = Callable[[Repository, Iterable[tuple[str, Digest]]], Found]
"""Loads the first good of ``(ref, digest)`` candidates from a store (``load_first_good``)."""


@dataclass(frozen=True)
class Newer:
    """A checkpoint the remote's ``latest`` names that is later than the local one."""

    ref: str
    target: Digest
    local: Digest | None
    """The local ``latest``'s target when this was found (None on a new node)."""


class RemoteResume:
    """What ``RemoteTier`` does for a resume and a heal (its attributes are set there)."""

    local: Repository
    latest: str
    pointers: list[str]
    jobs: int
    _remote: Repository | None
    _reader: Repository | None
    _remote_url: str
    _opening: threading.Lock
    _adopting: Newer | None
    _kept: KeptObjects | None

    def reader(self) -> Repository | None:
        """The remote for reads (a resume, a heal): the drain's handle once it is open, else a
        read-only one, so a resume waits for no probe of conditional writes and takes no lease
        there; None if no store is there yet (nothing to resume from)."""
        with self._opening:
            if self._remote is not None:
                return self._remote
            if self._reader is None:
                from cas.repo.opening import open as open_store

                try:
                    self._reader = open_store(self._remote_url, readonly=True)
                except NotFound:
                    return None  # the first run: the drain creates the store
            return self._reader

    def newer(self) -> Newer | None:
        """The checkpoint the remote's ``latest`` names if it is later than the local one (by
        phase, step, save time) or the local store has none; None otherwise, and when the
        remote cannot be read (logged: the local tier is used as it is)."""
        try:
            return self._newer()
        except CASError as e:
            log.warning("remote tier %s unreadable, resuming from the local tier: %s",
                        self._remote_url, e)  # fmt: skip
            return None

    def _newer(self) -> Newer | None:
        there = self.reader()
        if there is None:
            return None
        remote = there.find_ref(self.latest)
        if remote is None:
            return None
        local = self.local.find_ref(self.latest)
        if local is not None and local.target == remote.target:
            return None
        if local is not None and _position(self.local, local.target) >= _position(
            there, remote.target
        ):
            return None
        ref = remote.history[-1].message if remote.history else ""
        if not ref:
            return None
        return Newer(ref, remote.target, local.target if local is not None else None)

    def load_newer(self, newer: Newer, load: Loader) -> Found:
        """Load ``newer`` straight from the remote, objects the local store holds read here
        (module docstring); it joins the local tier with the run's next save (``settle``). If
        that fails, pull it into the local tier and load it from there."""
        there = self.reader()
        kept = KeptObjects(KEEP_BYTES)
        through = self.local.read_through(there, kept) if there is not None else None
        if through is not None and self._fits(through, newer.target):
            try:
                found = load(through, [(newer.ref, newer.target)])
            except CASError as e:
                log.warning("loading %s from the remote tier %s failed (%s); pulling it first",
                            newer.ref, self._remote_url, e)  # fmt: skip
            else:
                with self._opening:
                    self._adopting, self._kept = newer, kept
                return found
        self._adopt(newer)
        return load(self.local, resume_candidates(self.local, self.latest))

    def _fits(self, through: Repository, target: Digest) -> bool:
        """Whether the chunks of ``target`` the local store lacks fit in ``KEEP_BYTES``, so a
        load read through to the remote hands them all to the pull that adopts it. A larger
        checkpoint is pulled first and loaded from the local tier: each of its chunks then
        crosses the network once, not once for the load and again for the adopting pull. The
        manifest is read through ``through``, which remembers it for the load."""
        try:
            chunks = through.manifest(target).chunk_refs()
        except CASError:
            return True  # the load meets the same fault, and falls back to pulling first
        return self.local.lacking_bytes(chunks, KEEP_BYTES) <= KEEP_BYTES

    def settle(self) -> bool:
        """Adopt a checkpoint a resume loaded from the remote into the local tier (pull what
        the local store lacks, point the local ``latest`` at it), before a save moves that
        ``latest`` on. Whether there was one: the caller reads the local ``latest`` again (if
        the remote failed meanwhile, it is as it was, and the save starts the local history)."""
        with self._opening:
            newer, self._adopting = self._adopting, None
            kept, self._kept = self._kept, None
        if newer is None:
            return False
        try:
            self._adopt(newer, kept)
        except CASError as e:
            log.warning("could not keep %s from the remote tier %s in the local one: %s",
                        newer.ref, self._remote_url, e)  # fmt: skip
        return True

    def _adopt(self, newer: Newer, kept: KeptObjects | None = None) -> None:
        """Pull ``newer`` into the local tier and point the local ``latest`` at it, taking the
        objects a load kept (``kept``) from memory instead of the remote."""
        there = self.reader()
        if there is None:
            raise NotFound(f"no cas store at {self._remote_url}")
        # The run's history comes along onto a node that has none, so appends go on from it.
        extra = [
            h for h in self._histories() if self.local.find_ref(h) is None and there.find_ref(h)
        ]
        source = there.handing(kept) if kept else there
        self.local.pull(source, [newer.ref, *extra], jobs=self.jobs)
        self.local.set_ref(
            self.latest, newer.target, expected=newer.local,
            op="pull", message=newer.ref, overwrite=True,
        )  # fmt: skip
        log.info("resumed from the remote tier: pulled %s from %s", newer.ref, self._remote_url)

    def _histories(self) -> list[str]:
        """The pointers that are exact ref names (a run's history), not globs."""
        return [p for p in self.pointers if not any(c in p for c in "*?[")]

    def heal(self, ref: str, digest: Digest) -> bool:
        """Restore the checkpoint ``digest`` (named ``ref``) from the remote after a local read
        found it damaged or incomplete; whether the remote had it."""
        try:
            remote = self.reader()
            there = remote.find_ref(ref) if remote is not None else None
            if remote is None or there is None or there.target != digest:
                return False
            mine = self.local.find_ref(ref)
            if mine is not None and mine.target == digest:
                self.local.repair_from(remote, [ref])
            else:
                self.local.pull(remote, [ref], jobs=self.jobs)
        except CASError as e:
            log.warning("could not heal %s from %s: %s", ref, self._remote_url, e)
            return False
        log.warning("healed %s from the remote tier %s", ref, self._remote_url)
        return True


def _position(repo: Repository, digest: Digest) -> tuple[int, int, float]:
    """``(phase, step, saved at)`` of a manager checkpoint, for which of two is later."""
    try:
        meta = repo.manifest(digest).meta
    except NotFound:
        return (-1, -1, 0.0)
    phase, step, saved = meta.get("phase", 0), meta.get("step", 0), meta.get("saved_at", 0.0)
    return (
        phase if isinstance(phase, int) else 0,
        step if isinstance(step, int) else 0,
        float(saved) if isinstance(saved, (int, float)) else 0.0,
    )
