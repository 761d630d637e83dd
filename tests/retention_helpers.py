"""Helpers for the retention and GC tests: an injectable clock, small stores, distinct tensors."""

from __future__ import annotations

import calendar
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

import cas
from cas.blobstore import MemoryBlobStore
from cas.blobstore.base import BlobStore, BytesLike
from cas.blobstore.wrapper import BlobStoreWrapper
from cas.digest import Digest, digest_of
from cas.refs.renewal import THREAD_PREFIX
from cas.repo.config import StoreConfig
from cas.repo.repository import Repository


class FrozenWriter(BlobStoreWrapper):
    """A writer whose process can be frozen whole (a stopped process, a suspended VM): while
    frozen, its lease writes wait too, the renewal thread's included, as every thread would."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.thawed = threading.Event()
        self.thawed.set()

    def freeze(self) -> None:
        """Stop the writer's lease writes from now on (a write in flight still lands)."""
        self.thawed.clear()

    def thaw(self) -> None:
        """Let the writer run again."""
        self.thawed.set()

    def _wait(self, key: str) -> None:
        if key.startswith("leases/"):
            assert self.thawed.wait(60)

    def has(self, key: str) -> bool:
        self._wait(key)
        return self.inner.has(key)

    def put_transient(self, key: str, data: BytesLike) -> None:
        self._wait(key)
        self.inner.put_transient(key, data)


def renewal_threads(kind: str = "") -> list[threading.Thread]:
    """The lease and lock renewal threads running now (``lease`` or ``lock`` ones only)."""
    prefix = f"{THREAD_PREFIX}-{kind}"
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


class FakeClock:
    """A clock that only moves when told to (thread-safe)."""

    def __init__(self, start: float) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def set(self, when: float) -> None:
        with self._lock:
            self._now = when

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def utc(text: str) -> float:
    """``"2025-11-22 14:30"`` -> seconds since the epoch (UTC)."""
    return float(calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M")))


HOUR = 3600.0
DAY = 86400.0


def local_repo(
    root: Path, clock: Callable[[], float] = time.time, chunk_size: int = 4096, **extra: Any
) -> Repository:
    """A local store without fsync (fast tests) and small chunks."""
    config = StoreConfig(chunk_size=chunk_size, inline_max=64, extra=extra)
    return cas.open(root, config=config, clock=clock, fsync=False)


def memory_repo(clock: FakeClock, chunk_size: int = 4096, **extra: Any) -> Repository:
    """A memory store whose blob mtimes come from ``clock`` too."""
    config = StoreConfig(chunk_size=chunk_size, inline_max=64, extra=extra)
    return Repository(MemoryBlobStore(clock), config, clock=clock)


def tensor(seed: int, nbytes: int) -> torch.Tensor:
    """A float32 tensor of ``nbytes`` whose content depends only on ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 4, generator=generator)


CHUNK = 4096
"""The chunk size of the GC tests' stores: ``state`` makes two chunks per tensor."""


def state(*seeds: int) -> dict[str, Any]:
    """One 2-chunk tensor per seed."""
    return {f"t{s}": tensor(s, 2 * CHUNK) for s in seeds}


def chunks_of(*seeds: int) -> set[Digest]:
    """The chunk digests ``state(*seeds)`` is stored as, computed independently of cas."""
    out: set[Digest] = set()
    for s in seeds:
        data = tensor(s, 2 * CHUNK).numpy().tobytes()
        out |= {digest_of(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)}
    return out


def chunk_digests(repo: Repository) -> set[str]:
    """Digests of every stored chunk."""
    return {key.rsplit("/", 1)[1] for key in repo.blobs.list("chunks/")}


def reachable_chunks(repo: Repository, refs: Collection[str] | None = None) -> set[str]:
    """Chunks named by the current targets of ``refs`` (all refs by default)."""
    out: set[str] = set()
    for record in repo.refs():
        if refs is None or record.name in refs:
            out |= repo.manifest(record.target).chunk_digests()
    return out
