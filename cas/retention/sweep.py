"""Sweeping: listing objects for GC and deleting its candidates safely against concurrent writers.

Each candidate is checked at the last moment: an object modified at or after the plan's cutoff was
reused by a writer after GC listed it, and is spared. On a local store the check is exact: the
object is renamed into ``tmp/gc-trash`` first and its mtime read there. A writer's ``touch``
before the rename moved that mtime (the object goes back), one after it finds no file and the
writer stores the chunk again. A GC killed between rename and put-back leaves the object in the
trash; the next run puts everything found there back before it plans. Other stores ``stat`` and
then ``delete``, which leaves a window of one round trip.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

from cas.blobstore.base import BlobStore
from cas.blobstore.local import TMP_DIR
from cas.errors import NotFound
from cas.retention.space import CHUNK_KEY_RE, MANIFEST_KEY_RE

TRASH_DIR = TMP_DIR + "/gc-trash"
_TMP_NAME_RE = re.compile(r"[0-9a-f]{32}\.tmp")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")


Outcome = tuple[str, str, int]
"""``(key, "deleted" | "spared" | "gone", bytes freed)``."""


class Sweeper:
    """Deletes candidate objects, re-checking each one's mtime at the last moment.

    Deletions run on ``workers`` threads, ``BATCH`` keys at a time: each is a round trip on S3,
    and on a local file system mounted with online discard each unlink waits for the device.
    """

    BATCH = 4096

    def __init__(self, blobs: BlobStore, workers: int = 64) -> None:
        self.blobs = blobs
        self.workers = workers

    def recover(self) -> int:
        """Undo what a killed run left half done; return how many objects were put back."""
        return 0

    def scan(self, prefix: str, pattern: re.Pattern[str]) -> Iterator[tuple[str, int, float]]:
        """``(digest, size, mtime)`` of each object under ``prefix`` whose key ``pattern`` matches
        (group 2 is the digest); other keys are not cas objects and never GC's to delete."""
        for info in self.blobs.list_info(prefix):
            match = pattern.fullmatch(info.key)
            if match is not None:
                yield match.group(2), info.size, info.mtime

    def remove_many(self, keys: Iterable[str], cutoff: float) -> Iterator[Outcome]:
        """One outcome per key, in order."""
        with ThreadPoolExecutor(self.workers, thread_name_prefix="cas-sweep") as pool:
            for batch in _batches(keys, self.BATCH):
                yield from pool.map(lambda key: self.remove_one(key, cutoff), batch)

    def remove_one(self, key: str, cutoff: float) -> Outcome:
        """Delete one object unless it is gone or was modified at or after ``cutoff``."""
        try:
            info = self.blobs.stat(key)
        except NotFound:
            return key, "gone", 0
        if info.mtime >= cutoff:
            return key, "spared", 0
        self.blobs.delete(key)
        return key, "deleted", info.size

    def stale_tmp(self, cutoff: float) -> list[tuple[str, int]]:
        """Temp files older than the cutoff (only local stores have them)."""
        return []

    def remove_tmp(self, names: Iterable[str], cutoff: float) -> tuple[int, int]:
        """Delete those temp files that are still old; return count and bytes."""
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
        try:
            entries = list(os.scandir(self.trash))
        except FileNotFoundError:
            return 0
        for entry in entries:
            key = entry.name.replace("+", "/")
            if CHUNK_KEY_RE.fullmatch(key) or MANIFEST_KEY_RE.fullmatch(key):
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

    def scan(self, prefix: str, pattern: re.Pattern[str]) -> Iterator[tuple[str, int, float]]:
        # The shard directories directly: a million objects in a few seconds.
        top = self.root / prefix.rstrip("/")
        try:
            shards = [e for e in os.scandir(top) if _SHARD_RE.fullmatch(e.name) and e.is_dir()]
        except FileNotFoundError:
            return
        for shard in shards:
            with os.scandir(shard.path) as entries:
                for entry in entries:
                    name = entry.name
                    if len(name) != 64 or not name.startswith(shard.name):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if pattern.fullmatch(f"{prefix}{shard.name}/{name}"):
                        yield name, st.st_size, st.st_mtime

    def remove_many(self, keys: Iterable[str], cutoff: float) -> Iterator[Outcome]:
        self.trash.mkdir(parents=True, exist_ok=True)
        yield from super().remove_many(keys, cutoff)

    def remove_one(self, key: str, cutoff: float) -> Outcome:
        home = os.path.join(self.root, key)
        trashed = os.path.join(self.trash, key.replace("/", "+"))
        # Cheap first look: an object reused since planning is spared without ever leaving its
        # place, so readers of the checkpoint that reused it never miss it.
        try:
            if os.stat(home).st_mtime >= cutoff:
                return key, "spared", 0
            os.rename(home, trashed)
        except FileNotFoundError:
            return key, "gone", 0
        st = os.stat(trashed)
        if st.st_mtime >= cutoff:
            self._put_back(Path(trashed), Path(home))
            return key, "spared", 0
        os.unlink(trashed)
        return key, "deleted", st.st_size

    def stale_tmp(self, cutoff: float) -> list[tuple[str, int]]:
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
        return stale

    def remove_tmp(self, names: Iterable[str], cutoff: float) -> tuple[int, int]:
        count = size = 0
        for name in names:
            if not _TMP_NAME_RE.fullmatch(name):
                continue
            path = self.root / TMP_DIR / name
            with contextlib.suppress(FileNotFoundError):
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


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
