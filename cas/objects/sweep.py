"""Sweeping: deleting candidate objects safely against writers that reuse them meanwhile.

Each candidate is checked at the last moment: an object modified at or after the plan's cutoff was
reused by a writer after GC listed it, and is spared. On a local store the check is exact: the
object is renamed into ``tmp/gc-trash`` first and its mtime read there. A writer's ``touch``
before the rename moved that mtime (the object goes back), one after it finds no file and the
writer stores the chunk again. A GC killed between rename and put-back leaves the object in the
trash; the next run puts everything found there back before it plans. Other stores ``stat`` and
then ``delete``; what makes that safe against a writer's touch in between is above this layer: the
caller announces each batch (``Window``), and writers check the announcements before they commit
(``cas.refs.sweeps``). Which sweeper a store gets is decided by its capabilities (``local_root``
and ``supports_rename``), never by its class.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from cas.blobstore.base import BlobStore
from cas.blobstore.local import TMP_DIR, disk_errors
from cas.blobstore.tempfiles import dead_files, remove_dead
from cas.digest import Digest
from cas.errors import NotFound
from cas.objects.keys import ObjectKind, object_key, parse_object_key

TRASH_DIR = TMP_DIR + "/gc-trash"
_TMP_NAME_RE = re.compile(r"[0-9a-f]{32}\.tmp")

Candidate = tuple[ObjectKind, Digest]
"""An object GC planned to delete."""


@dataclass(frozen=True)
class Window:
    """How the caller brackets deletions: ``batch()`` around each batch (every delete of it has
    returned when it exits), ``guard()`` right before each delete (raises to stop)."""

    batch: Callable[[], AbstractContextManager[None]] = nullcontext
    guard: Callable[[], None] = lambda: None
    size: int = 4096


NO_WINDOW = Window()


@dataclass(frozen=True)
class SweepOutcome:
    """What happened to one candidate: ``deleted`` (``size`` bytes freed), ``spared`` (reused
    since the plan) or ``gone`` (already deleted)."""

    kind: ObjectKind
    digest: Digest
    status: str
    size: int = 0


class Sweeper:
    """Deletes candidate objects, re-checking each one's mtime at the last moment.

    Deletions run on ``workers`` threads, a ``Window`` batch at a time: each is a round trip on
    S3, and on a local file system mounted with online discard each unlink waits for the device.
    """

    def __init__(self, blobs: BlobStore, workers: int = 64) -> None:
        self.blobs = blobs
        self.workers = workers

    def recover(self) -> int:
        """Undo what a killed run left half done; return how many objects were put back."""
        return 0

    def remove_many(
        self, candidates: Iterable[Candidate], cutoff: float, window: Window = NO_WINDOW
    ) -> Iterator[SweepOutcome]:
        """One outcome per candidate, in order, ``window.size`` at a time inside ``window``."""
        with ThreadPoolExecutor(self.workers, thread_name_prefix="cas-sweep") as pool:
            for batch in _batches(candidates, window.size):
                with window.batch():
                    outcomes = list(
                        pool.map(lambda c: self.remove_one(c[0], c[1], cutoff, window.guard), batch)
                    )
                yield from outcomes

    def remove_one(
        self,
        kind: ObjectKind,
        digest: Digest,
        cutoff: float,
        guard: Callable[[], None] = NO_WINDOW.guard,
    ) -> SweepOutcome:
        """Delete one object unless it is gone or was modified at or after ``cutoff``; ``guard``
        runs right before the delete."""
        key = object_key(kind, digest)
        try:
            info = self.blobs.stat(key)
        except NotFound:
            return SweepOutcome(kind, digest, "gone")
        if info.mtime >= cutoff:
            return SweepOutcome(kind, digest, "spared")
        guard()
        self.blobs.delete(key)
        return SweepOutcome(kind, digest, "deleted", info.size)

    def stale_tmp(self, cutoff: float) -> list[tuple[str, int]]:
        """Temp files older than the cutoff, and those of writers certainly gone whatever their
        age (only local stores have them)."""
        return []

    def remove_tmp(self, names: Iterable[str], cutoff: float) -> tuple[int, int]:
        """Delete those temp files that are still old or still a gone writer's; return count and
        bytes."""
        return 0, 0


class LocalSweeper(Sweeper):
    """Sweeps a local store by renaming into ``tmp/gc-trash``, so a concurrent touch is never lost.

    The rename is the linearization point: a writer's ``touch`` before it moves the mtime of the
    renamed file (seen here: the object goes back), one after it finds no file and stores the
    chunk again. Only a touch in the microseconds between the first ``stat`` and the rename makes
    the object briefly absent (a reader then would get NotFound once); it is never lost.
    """

    def __init__(self, blobs: BlobStore, root: Path) -> None:
        super().__init__(blobs)
        self.root = root
        self.trash = root / TRASH_DIR

    def recover(self) -> int:
        restored = 0
        with disk_errors("putting back what GC set aside in", self.trash):
            try:
                entries = list(os.scandir(self.trash))
            except FileNotFoundError:
                return 0
            for entry in entries:
                key = entry.name.replace("+", "/")
                if parse_object_key(key) is not None:
                    restored += self._put_back(Path(entry.path), self.root / key)
        return restored

    @staticmethod
    def _put_back(trashed: Path, home: Path) -> int:
        try:
            home.parent.mkdir(parents=True, exist_ok=True)
            os.link(trashed, home)  # never replaces a copy a writer stored meanwhile
            restored = 1
        except FileExistsError:
            restored = 0
        os.unlink(trashed)
        return restored

    def remove_many(
        self, candidates: Iterable[Candidate], cutoff: float, window: Window = NO_WINDOW
    ) -> Iterator[SweepOutcome]:
        with disk_errors("deleting objects from", self.root):
            self.trash.mkdir(parents=True, exist_ok=True)
            yield from super().remove_many(candidates, cutoff, window)

    def remove_one(
        self,
        kind: ObjectKind,
        digest: Digest,
        cutoff: float,
        guard: Callable[[], None] = NO_WINDOW.guard,
    ) -> SweepOutcome:
        key = object_key(kind, digest)
        home = os.path.join(self.root, key)
        trashed = os.path.join(self.trash, key.replace("/", "+"))
        # Cheap first look: an object reused since planning is spared without ever leaving its
        # place, so readers of the checkpoint that reused it never miss it.
        try:
            if os.stat(home).st_mtime >= cutoff:
                return SweepOutcome(kind, digest, "spared")
            guard()
            os.rename(home, trashed)
        except FileNotFoundError:
            return SweepOutcome(kind, digest, "gone")
        try:
            st = os.stat(trashed)
        except OSError:
            # Whether a writer reused it is unknown: it goes back (or, should that fail too, the
            # next run's ``recover`` puts it back before planning).
            self._put_back(Path(trashed), Path(home))
            raise
        if st.st_mtime >= cutoff:
            self._put_back(Path(trashed), Path(home))
            return SweepOutcome(kind, digest, "spared")
        os.unlink(trashed)
        return SweepOutcome(kind, digest, "deleted", st.st_size)

    def stale_tmp(self, cutoff: float) -> list[tuple[str, int]]:
        with disk_errors("listing", self.root / TMP_DIR):
            return self._stale_tmp(cutoff)

    def _stale_tmp(self, cutoff: float) -> list[tuple[str, int]]:
        stale = []
        try:
            entries = list(os.scandir(self.root / TMP_DIR))
        except FileNotFoundError:
            return []
        for entry in entries:
            if _TMP_NAME_RE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    if st.st_mtime < cutoff:
                        stale.append((entry.name, st.st_size))
        # A writer certainly gone (its lock is free) left these: stale whatever their age.
        return stale + dead_files(self.root / TMP_DIR)

    def remove_tmp(self, names: Iterable[str], cutoff: float) -> tuple[int, int]:
        names = list(names)
        with disk_errors("deleting temp files in", self.root / TMP_DIR):
            count, size = remove_dead(self.root / TMP_DIR, names)
        for name in names:
            if not _TMP_NAME_RE.fullmatch(name):
                continue
            path = self.root / TMP_DIR / name
            with disk_errors("deleting", path), contextlib.suppress(FileNotFoundError):
                st = path.stat()
                if st.st_mtime < cutoff:
                    path.unlink()
                    count += 1
                    size += st.st_size
        return count, size


def sweeper_for(blobs: BlobStore) -> Sweeper:
    """The safest sweeper the store allows (read-only stores get one that fails on delete)."""
    root = blobs.local_root
    if root is not None and blobs.supports_rename:
        return LocalSweeper(blobs, root)
    return Sweeper(blobs)


def _batches(items: Iterable[Candidate], size: int) -> Iterator[list[Candidate]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
