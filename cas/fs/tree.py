"""Which ref owns a path, and the files its checkpoint shows: the ``cas://`` namespace, cached.

Refs and every prefix of a ref name are directories. A path belongs to the *longest ref that is
the path or one of its ancestors*; the rest of the path names a file inside that checkpoint. Ref
names and targets are cached for ``ttl`` seconds (by the injected clock), and dropped at once
when this process changes a ref of the store through any Repository on it (a ``repo.save`` next
to the filesystem: ``Repository.local_ref_change``); another process's change is seen within
``ttl``. Manifests are immutable, so their decoded views are kept in a small LRU. Directories
made inside a checkpoint before any file is written below them exist only here
(``pseudo_dirs``): manifests hold files, not folders.
"""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cas.digest import Digest
from cas.fs.extents import FileView
from cas.fs.views import manifest_views
from cas.model.manifest import Manifest
from cas.repo.repository import Repository

MANIFEST_CACHE = 32
"""Decoded manifests (and their file views) kept per filesystem."""


@dataclass(frozen=True)
class Snapshot:
    """A ref as read at one moment: its manifest and the files it shows."""

    ref: str
    digest: Digest
    manifest: Manifest
    views: dict[str, FileView]
    dirs: frozenset[str]


def _dirs_of(paths: Iterable[str]) -> frozenset[str]:
    out: set[str] = set()
    for path in paths:
        parts = path.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(out)


class CheckpointTree:
    """Paths of one store resolved to refs and files, with short-lived caches of refs."""

    def __init__(self, repo: Repository, clock: Callable[[], float], ttl: float) -> None:
        self.repo = repo
        self.clock = clock
        self.ttl = ttl
        self.pseudo_dirs: set[str] = set()
        self._names: dict[str, tuple[float, list[str]]] = {}
        self._records: dict[str, tuple[float, Digest | None]] = {}
        self._seen_change = repo.local_ref_change()
        self._manifests: OrderedDict[
            Digest, tuple[Manifest, dict[str, FileView], frozenset[str]]
        ] = OrderedDict()
        self._lock = threading.Lock()

    def _drop_if_changed(self) -> None:
        """Forget cached refs if this process changed a ref of the store since they were read."""
        change = self.repo.local_ref_change()
        if change != self._seen_change:
            self.invalidate()
            self._seen_change = change

    def ref_names(self, first: str) -> list[str]:
        """Ref names equal to or below the first path segment ``first`` ("" for all)."""
        self._drop_if_changed()
        cached = self._names.get(first)
        now = self.clock()
        if cached is None or now - cached[0] > self.ttl:
            cached = (now, list(self.repo.ref_names(first)))
            self._names[first] = cached
        return cached[1]

    def target(self, ref: str) -> Digest | None:
        """The manifest ``ref`` names (None if there is no such ref), as cached."""
        self._drop_if_changed()
        cached = self._records.get(ref)
        now = self.clock()
        if cached is None or now - cached[0] > self.ttl:
            record = self.repo.find_ref(ref)
            cached = (now, record.target if record else None)
            self._records[ref] = cached
        return cached[1]

    def invalidate(self) -> None:
        """Forget cached ref names and targets (manifests are immutable and stay cached)."""
        self._names.clear()
        self._records.clear()

    def owner(self, path: str) -> tuple[str | None, str]:
        """The longest ref that is ``path`` or an ancestor of it, and the rest of the path."""
        if not path:
            return None, ""
        parts = path.split("/")
        names = set(self.ref_names(parts[0]))
        for i in range(len(parts), 0, -1):
            candidate = "/".join(parts[:i])
            if candidate in names:
                return candidate, "/".join(parts[i:])
        return None, path

    def snapshot(self, ref: str) -> Snapshot | None:
        """What ``ref`` names now and the files it shows (None if there is no such ref)."""
        digest = self.target(ref)
        if digest is None:
            return None
        with self._lock:
            cached = self._manifests.get(digest)
            if cached is not None:
                self._manifests.move_to_end(digest)
        if cached is None:
            manifest = self.repo.manifest(digest)
            views = manifest_views(manifest, digest)
            cached = (manifest, views, _dirs_of(views))
            with self._lock:
                self._manifests[digest] = cached
                while len(self._manifests) > MANIFEST_CACHE:
                    self._manifests.popitem(last=False)
        return Snapshot(ref, digest, *cached)

    def file(self, path: str) -> tuple[Snapshot, str, FileView]:
        """The checkpoint holding the file at ``path``, its path inside, and its view;
        IsADirectoryError or FileNotFoundError when there is no such file."""
        ref, rel = self.owner(path)
        snapshot = self.snapshot(ref) if ref is not None else None
        if snapshot is None or rel not in snapshot.views:
            if snapshot is not None and (rel == "" or rel in snapshot.dirs):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            if ref is None and self.is_prefix_dir(path):
                raise IsADirectoryError(errno.EISDIR, "is a directory", path)
            raise FileNotFoundError(errno.ENOENT, "no such file in the store", path)
        return snapshot, rel, snapshot.views[rel]

    def is_prefix_dir(self, path: str) -> bool:
        """Whether ``path`` is a proper prefix of some ref's name (a directory of refs)."""
        return any(name.startswith(path + "/") for name in self.ref_names(path.split("/")[0]))
