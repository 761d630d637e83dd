"""Delta base chains on the write side: which chunks a stored chunk needs to decode, and a cache.

GC keeps chunks alive from manifests alone (invariant 4), so a tensor entry whose chunks are
delta-encoded lists every chunk they need, transitively, in ``encoding["base"]``. A writer learns
those chains three ways: from the chunk it just encoded (its base, plus the base's chain), from
the parent manifest (which already lists its tensors' chains), and, for a reused chunk that
neither explains, from stored headers (``ObjectStore.chunk_base``, one small read per hop).

The parent manifest only says, per tensor, "every chunk of this tensor needs at most these bases
and at most this depth"; that is an upper bound, which is all GC (keep more, never less) and the
depth limit (a keyframe a little early) need.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cas.digest import Digest, digest_to_bytes
from cas.errors import FormatError, IntegrityError
from cas.model.manifest import Manifest, TensorEntry
from cas.objects.store import MAX_DELTA_DEPTH, ObjectStore


@dataclass(frozen=True)
class Chain:
    """What one stored chunk needs besides itself: its bases, transitively, and the chain depth."""

    depth: int
    bases: frozenset[Digest]

    def on_top_of(self, base: Digest) -> Chain:
        """The chain of a chunk encoded against ``base``, given that this is ``base``'s chain."""
        return Chain(self.depth + 1, self.bases | {base})

    def merge(self, other: Chain) -> Chain:
        """An upper bound of both (one tensor's chunks together)."""
        if not other.bases and other.depth <= self.depth:
            return self
        return Chain(max(self.depth, other.depth), self.bases | other.bases)


STANDALONE = Chain(0, frozenset())


def entry_chain(entry: TensorEntry) -> Chain:
    """The chain bound a manifest records for a tensor (``STANDALONE`` when none)."""
    encoding = entry.encoding or {}
    bases = frozenset(entry.base_digests())
    depth = encoding.get("depth", len(bases))
    if not isinstance(depth, int) or depth < 0:
        raise FormatError(f"corrupt manifest: bad delta depth {depth!r}")
    # A chain visits distinct bases, so it is never longer than the set of them.
    return Chain(min(depth, len(bases)), bases)


def encoding_record(codec_name: str, chain: Chain) -> dict[str, Any] | None:
    """``TensorEntry.encoding`` for a tensor written with ``codec_name`` whose chunks need ``chain``."""
    if codec_name == "raw" and not chain.bases:
        return None
    record: dict[str, Any] = {"codec": codec_name}
    if chain.bases:
        record["depth"] = chain.depth
        record["base"] = [digest_to_bytes(d) for d in sorted(chain.bases)]
    return record


class ChainIndex:
    """Chains of stored chunks known to one write: seeded from a manifest, extended by headers."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self._known: dict[Digest, Chain] = {}
        self._lock = threading.Lock()

    def learn_manifest(self, manifest: Manifest) -> None:
        """Record the chain bounds a manifest states for its tensors' chunks and their bases."""
        with self._lock:
            for entry in manifest.tensors:
                try:
                    chain = entry_chain(entry)
                except FormatError:
                    continue  # unknown chunks are followed through their headers instead
                # A chunk listed by several entries needs at most what their bounds say together
                # (after a push, the entry that lists its base need not be the first one).
                for ref in entry.chunks:
                    self._bound(ref.digest, chain)
                for base in chain.bases:
                    self._bound(base, Chain(max(chain.depth - 1, 0), chain.bases))

    def _bound(self, digest: Digest, chain: Chain) -> None:
        known = self._known.get(digest)
        self._known[digest] = chain if known is None else known.merge(chain)

    def learn(self, digest: Digest, chain: Chain) -> None:
        """Record a chunk this write stored or verified."""
        with self._lock:
            self._known[digest] = chain

    def chain_of(self, digest: Digest) -> Chain:
        """The chain of a stored chunk; NotFound or IntegrityError when it is broken.

        Unknown chunks are followed header by header, refusing cycles and chains deeper than a
        reader would follow.
        """
        with self._lock:
            known = self._known.get(digest)
        if known is not None:
            return known
        path: list[tuple[Digest, Digest]] = []
        current = digest
        while True:
            with self._lock:
                known = self._known.get(current)
            if known is not None:
                chain = known
                break
            base = self.objects.chunk_base(current)
            if base is None:
                chain = STANDALONE
                self.learn(current, chain)
                break
            if len(path) >= MAX_DELTA_DEPTH or base == current or any(base == d for d, _ in path):
                raise IntegrityError(
                    f"chunk {digest}: delta chain loops or is deeper than {MAX_DELTA_DEPTH}"
                )
            path.append((current, base))
            current = base
        for chunk, base in reversed(path):
            chain = chain.on_top_of(base)
            self.learn(chunk, chain)
        return chain


KEYFRAME_MEMO = 1 << 20
"""Chunk-to-keyframe entries a cache remembers (about 150 MB at most) before starting over."""


class ChunkCache:
    """Decoded bytes of recently written or read chunks, bounded in bytes, least recently used out.

    Keeps the previous checkpoint at hand so the next save encodes deltas against it without
    reading and decoding it back from the store.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[Digest, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self._keyframes: dict[Digest, Digest] = {}

    def keyframe(self, digest: Digest) -> Digest | None:
        """The keyframe a chunk this process wrote or resolved is encoded against (or itself)."""
        with self._lock:
            return self._keyframes.get(digest)

    def note_keyframe(self, digest: Digest, keyframe: Digest) -> None:
        """Remember ``digest``'s keyframe. A chunk rewritten standalone since leaves this stale,
        which is harmless: the keyframe is standalone and still a valid base, and one swept
        since fails the writer's refresh of its bases before any commit."""
        with self._lock:
            if len(self._keyframes) >= KEYFRAME_MEMO:
                self._keyframes.clear()
            self._keyframes[digest] = keyframe

    def get(self, digest: Digest) -> bytes | None:
        """The cached bytes, or None."""
        with self._lock:
            data = self._items.get(digest)
            if data is not None:
                self._items.move_to_end(digest)
            return data

    def put(self, digest: Digest, data: bytes) -> None:
        """Remember ``data`` (already verified to hash to ``digest``)."""
        if len(data) > self.max_bytes:
            return
        with self._lock:
            if digest in self._items:
                self._items.move_to_end(digest)
                return
            self._items[digest] = data
            self._size += len(data)
            while self._size > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._size -= len(dropped)

    @property
    def size(self) -> int:
        """Bytes held."""
        return self._size
