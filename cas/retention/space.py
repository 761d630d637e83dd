"""Space accounting, written once: logical, stored, exclusive and shared bytes of checkpoints.

Logical bytes are what a reader gets back; stored bytes are the sizes of objects as the store
reports them (headers included), each object counted once however many checkpoints name it. An
object is a chunk or a manifest, identified by kind and digest. Everything is computed from refs
and manifests (which objects each names) plus the stored size of each object (one listing, or one
``stat`` per object for small sets), never from chunk payloads.

``Accounting`` holds reference counts of objects over a set of refs: the stored bytes they add up
to, what dropping one ref frees (objects no other counted ref names) and each ref's exclusive
bytes. ``cas du`` (``disk_usage``), the retention planner's size budget (``cas.retention.plan``)
and ``cas show`` (``manifest_usage``) all count with it. Ref history is not counted here;
``cas gc`` keeps recent history alive for a while.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cas.digest import Digest
from cas.errors import CASError
from cas.model.manifest import Manifest, decode_manifest
from cas.names import ref_matches
from cas.objects.keys import ObjectKind
from cas.refs.listing import DamagedRef, list_refs
from cas.refs.records import RefRecord
from cas.refs.stores import Stores

ObjectId = tuple[ObjectKind, Digest]
"""A stored object: a chunk or a manifest, by digest."""


@dataclass(frozen=True)
class RefContent:
    """What one ref names, read from its manifest: metadata and the set of objects it keeps."""

    record: RefRecord
    kind: str
    created_at: float
    meta: dict[str, Any]
    logical_bytes: int
    objects: frozenset[ObjectId]
    chunk_sizes: dict[Digest, int]
    """Decoded size of each chunk the ref names."""

    @property
    def name(self) -> str:
        """The ref's name."""
        return self.record.name

    @property
    def target(self) -> Digest:
        """The manifest digest the ref names."""
        return self.record.target


def read_manifest(stores: Stores, digest: Digest, context: str) -> Manifest:
    """Decode a manifest, turning failures into errors that say which ref needed it."""
    try:
        return decode_manifest(stores.objects.get_manifest(digest))
    except CASError as e:
        raise type(e)(f"{context}: manifest {digest[:16]}: {e}") from e


def read_contents(
    stores: Stores, records: Sequence[RefRecord], damaged: list[DamagedRef] | None = None
) -> list[RefContent]:
    """The content of each ref (each distinct manifest is read once, in parallel).

    A manifest that cannot be read raises, unless ``damaged`` is given: then each ref naming it
    is appended there and left out, so one damaged manifest hides nothing else.
    """
    targets = sorted({r.target for r in records})
    owner = {r.target: r.name for r in reversed(records)}

    def read(digest: Digest) -> Manifest | CASError:
        if damaged is None:
            return read_manifest(stores, digest, f"ref {owner[digest]!r}")
        try:
            return decode_manifest(stores.objects.get_manifest(digest))
        except CASError as e:
            return e

    manifests = dict(zip(targets, stores.pool.map(read, targets), strict=True))
    summaries: dict[Digest, tuple[frozenset[ObjectId], dict[Digest, int]]] = {}
    out = []
    for record in records:
        manifest = manifests[record.target]
        if isinstance(manifest, CASError):
            assert damaged is not None
            damaged.append(DamagedRef(record.name, f"manifest {record.target[:16]}: {manifest}"))
            continue
        if record.target not in summaries:
            decoded = {ref.digest: ref.size for ref in manifest.chunk_refs()}
            named: set[ObjectId] = {(ObjectKind.MANIFEST, record.target)}
            named.update((ObjectKind.CHUNK, d) for d in manifest.chunk_digests())
            summaries[record.target] = (frozenset(named), decoded)
        objects, sizes = summaries[record.target]
        out.append(
            RefContent(
                record,
                manifest.kind,
                manifest.created_at,
                manifest.meta,
                manifest.logical_bytes(),
                objects,
                sizes,
            )
        )
    return out


def readable_contents(stores: Stores) -> tuple[list[RefContent], tuple[DamagedRef, ...]]:
    """The content of every ref that can be read, and every ref whose record or manifest
    cannot (for reports that must not let one damaged ref hide the rest)."""
    listing = list_refs(stores.refs)
    damaged = list(listing.damaged)
    contents = read_contents(stores, listing.records, damaged)
    return contents, tuple(sorted(damaged, key=lambda d: d.ref))


class Accounting:
    """Reference counts of objects over a set of refs, and the stored bytes they add up to.

    ``sizes`` are stored bytes per object (an object missing from it counts 0). ``drop`` removes
    one ref from the count and returns what that frees: the objects no remaining ref names.
    """

    def __init__(self, sizes: dict[ObjectId, int], contents: Iterable[RefContent]) -> None:
        self.sizes = sizes
        self.counts: Counter[ObjectId] = Counter()
        for content in contents:
            self.counts.update(content.objects)
        self.before = self.total = self.bytes_of(self.counts)

    def bytes_of(self, objects: Iterable[ObjectId]) -> int:
        """Stored bytes of the objects (each counted once)."""
        return sum(self.sizes.get(o, 0) for o in set(objects))

    def exclusive(self, content: RefContent) -> int:
        """Bytes of the ref's objects no other counted ref names (freed if it alone went)."""
        return sum(self.sizes.get(o, 0) for o in content.objects if self.counts[o] == 1)

    def drop(self, content: RefContent) -> int:
        """Stop counting the ref; return the bytes this frees."""
        freed = 0
        for obj in content.objects:
            self.counts[obj] -= 1
            if self.counts[obj] == 0:
                freed += self.sizes.get(obj, 0)
        self.total -= freed
        return freed


@dataclass(frozen=True)
class RefUsage:
    """One ref's line in ``cas du``."""

    ref: str
    manifest: Digest
    logical_bytes: int
    stored_bytes: int
    exclusive_bytes: int


@dataclass(frozen=True)
class UsageReport:
    """``cas du``: the selected refs together, and each of them."""

    selector: str
    refs: tuple[RefUsage, ...]
    logical_bytes: int
    stored_bytes: int
    exclusive_bytes: int
    missing_objects: int
    damaged: tuple[DamagedRef, ...] = ()
    """Refs whose record or manifest could not be read: not counted. Objects only they name
    count as exclusive to the selection, so exclusive bytes may be overstated."""

    @property
    def shared_bytes(self) -> int:
        """Stored bytes the selection shares with refs outside it."""
        return self.stored_bytes - self.exclusive_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "selector": self.selector,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "exclusive_bytes": self.exclusive_bytes,
            "shared_bytes": self.shared_bytes,
            "missing_objects": self.missing_objects,
            "refs": [u.__dict__ for u in self.refs],
            "damaged": [d.to_dict() for d in self.damaged],
        }


def disk_usage(stores: Stores, selector: str = "") -> UsageReport:
    """Logical, stored, exclusive (freed if the selection were removed) and shared bytes of
    the refs that can be read; the damaged ones are reported, not counted."""
    contents, damaged = readable_contents(stores)
    selected = [c for c in contents if ref_matches(c.name, selector)]
    union = {o for c in selected for o in c.objects}
    accounting = Accounting(stores.objects.stored_sizes(union), contents)
    rows = tuple(
        RefUsage(
            c.name,
            c.target,
            c.logical_bytes,
            accounting.bytes_of(c.objects),
            accounting.exclusive(c),
        )
        for c in selected
    )
    # What only the selection names is exactly what dropping all of it frees.
    exclusive = sum(accounting.drop(c) for c in selected)
    return UsageReport(
        selector,
        rows,
        sum(c.logical_bytes for c in selected),
        accounting.bytes_of(union),
        exclusive,
        len(union - accounting.sizes.keys()),
        damaged,
    )


@dataclass(frozen=True)
class GroupUsage:
    """One group of refs (a run, say): logical bytes, stored bytes, and the stored bytes no ref
    outside the group names (freed if the whole group were forgotten, then collected)."""

    group: str
    refs: int
    logical_bytes: int
    stored_bytes: int
    exclusive_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return dict(self.__dict__)


class UsageIndex:
    """Every readable ref's objects and their reference counts, read once: a view that asks
    many questions (each run's bytes, one checkpoint's exclusive bytes, the total) asks it."""

    def __init__(self, stores: Stores) -> None:
        self.contents, self.damaged = readable_contents(stores)
        union = {o for c in self.contents for o in c.objects}
        self.accounting = Accounting(stores.objects.stored_sizes(union), self.contents)
        self.by_name = {c.name: c for c in self.contents}

    @property
    def referenced_bytes(self) -> int:
        """Stored bytes every readable ref reaches together (``cas du`` of everything)."""
        return self.accounting.before

    def exclusive(self, ref: str) -> int:
        """Stored bytes only ``ref`` names (``cas du REF``'s exclusive); NotFound-free: 0 for a
        ref that is not readable."""
        content = self.by_name.get(ref)
        return self.accounting.exclusive(content) if content is not None else 0

    def groups(self, group_of: Callable[[str], str | None]) -> list[GroupUsage]:
        """Usage per group of refs; ``group_of`` names a ref's group (None: in no group, but its
        objects still count as shared with the groups that name them too)."""
        owner: dict[ObjectId, str | None] = {}
        members: dict[str, list[RefContent]] = {}
        for content in self.contents:
            group = group_of(content.name)
            if group is not None:
                members.setdefault(group, []).append(content)
            for obj in content.objects:
                # An object named from two groups (or from outside every group) is no group's.
                owner[obj] = group if owner.get(obj, group) == group else None
        sizes = self.accounting.sizes
        out = []
        for group, named in sorted(members.items()):
            objects = {o for c in named for o in c.objects}
            out.append(
                GroupUsage(
                    group,
                    len(named),
                    sum(c.logical_bytes for c in named),
                    sum(sizes.get(o, 0) for o in objects),
                    sum(sizes.get(o, 0) for o in objects if owner.get(o) == group),
                )
            )
        return out


@dataclass(frozen=True)
class StoreStats:
    """``cas stats``: what the store holds and how much dedup and compression save."""

    refs: int
    manifests: int
    manifest_bytes: int
    chunks: int
    chunk_bytes: int
    reachable_chunks: int
    reachable_stored_bytes: int
    """Stored bytes of the chunks refs reach."""
    unique_bytes: int
    """Decoded bytes of the distinct chunks refs reach."""
    logical_bytes: int
    """What every ref would take as an independent copy."""
    damaged: tuple[DamagedRef, ...] = ()
    """Refs whose record or manifest could not be read: not counted, and what only they name
    counts as unreachable."""
    quarantined_objects: int = 0
    """Chunks and manifests found corrupt and moved aside (``cas.objects.quarantine``)."""
    quarantined_bytes: int = 0
    """What the quarantine area holds (the bytes as found, and their records)."""
    reachable_manifest_bytes: int = 0
    """Stored bytes of the manifests refs reach (small tensors are inlined there)."""

    @property
    def stored_bytes(self) -> int:
        """What the refs' checkpoints occupy on storage: the chunks and manifests they reach,
        each once; ``cas du``'s stored bytes over every ref."""
        return self.reachable_stored_bytes + self.reachable_manifest_bytes

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per byte stored on disk (``logical_bytes / stored_bytes``): copies and
        unchanged tensors cost nothing, and compression and delta encoding count too."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        """Decoded bytes per stored byte of the reachable chunks."""
        return (
            self.unique_bytes / self.reachable_stored_bytes if self.reachable_stored_bytes else 1.0
        )

    @property
    def unreachable_bytes(self) -> int:
        """Stored chunk bytes no ref reaches (``cas gc`` frees them after the grace period)."""
        return self.chunk_bytes - self.reachable_stored_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            **self.__dict__,
            "damaged": [d.to_dict() for d in self.damaged],
            "stored_bytes": self.stored_bytes,
            "dedup_ratio": round(self.dedup_ratio, 4),
            "compression_ratio": round(self.compression_ratio, 4),
            "unreachable_bytes": self.unreachable_bytes,
        }


def store_stats(stores: Stores) -> StoreStats:
    """Count chunks and manifests, and the dedup and compression ratios of what the readable
    refs reach; the damaged ones are reported, not counted."""
    contents, damaged = readable_contents(stores)
    decoded: dict[Digest, int] = {}
    named: set[ObjectId] = set()
    for content in contents:
        decoded.update(content.chunk_sizes)
        named |= content.objects
    chunks = chunk_bytes = reachable = reachable_bytes = 0
    for stored in stores.objects.list_objects(ObjectKind.CHUNK):
        chunks += 1
        chunk_bytes += stored.size
        if (ObjectKind.CHUNK, stored.digest) in named:
            reachable += 1
            reachable_bytes += stored.size
    manifests = manifest_bytes = reachable_manifest_bytes = 0
    for stored in stores.objects.list_objects(ObjectKind.MANIFEST):
        manifests += 1
        manifest_bytes += stored.size
        if (ObjectKind.MANIFEST, stored.digest) in named:
            reachable_manifest_bytes += stored.size
    quarantine = stores.objects.quarantine.summary()
    return StoreStats(
        refs=len(contents),
        manifests=manifests,
        manifest_bytes=manifest_bytes,
        chunks=chunks,
        chunk_bytes=chunk_bytes,
        reachable_chunks=reachable,
        reachable_stored_bytes=reachable_bytes,
        unique_bytes=sum(decoded.values()),
        logical_bytes=sum(c.logical_bytes for c in contents),
        damaged=damaged,
        quarantined_objects=quarantine.objects,
        quarantined_bytes=quarantine.stored_bytes,
        reachable_manifest_bytes=reachable_manifest_bytes,
    )


@dataclass(frozen=True)
class Usage:
    """Sizes of one manifest's data (``cas show``).

    ``stored_bytes`` counts the manifest (tensors of at most ``inline_max`` bytes live in it) and
    the chunks the checkpoint names itself (what keeping it costs on top of its bases); a
    delta-encoded checkpoint needs its bases too, and ``stored_with_bases`` counts them: the
    stored bytes ``cas du`` gives the ref.
    """

    logical_bytes: int
    stored_bytes: int
    stored_with_bases: int
    chunks: int
    base_chunks: int
    missing_chunks: int
    manifest_bytes: int = 0

    @property
    def ratio(self) -> float:
        """``stored_bytes / logical_bytes`` (0 for an empty checkpoint)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """Plain numbers for ``--json``."""
        return {
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "stored_with_bases": self.stored_with_bases,
            "ratio": round(self.ratio, 4),
            "chunks": self.chunks,
            "base_chunks": self.base_chunks,
            "missing_chunks": self.missing_chunks,
            "manifest_bytes": self.manifest_bytes,
        }


def chunk_sizes(stores: Stores, digests: Iterable[Digest]) -> dict[Digest, int | None]:
    """Stored size of each unique chunk (``None`` when it is missing)."""
    unique = set(digests)
    found = stores.objects.stored_sizes((ObjectKind.CHUNK, d) for d in unique)
    return {d: found.get((ObjectKind.CHUNK, d)) for d in sorted(unique)}


def stored_bytes(stores: Stores, digests: Iterable[Digest]) -> int:
    """Bytes the unique chunks among ``digests`` occupy in the store (missing ones count 0)."""
    return sum(size or 0 for size in chunk_sizes(stores, digests).values())


def manifest_usage(stores: Stores, manifest: Manifest, digest: Digest | None = None) -> Usage:
    """Logical and stored bytes of one manifest (reads chunk sizes, never chunk data); with its
    ``digest``, the stored manifest itself counts too."""
    own = {ref.digest for ref in manifest.chunk_refs()}
    bases = manifest.chunk_digests() - own
    sizes = chunk_sizes(stores, own | bases)
    manifest_bytes = 0
    if digest is not None:
        found = stores.objects.stored_sizes([(ObjectKind.MANIFEST, digest)])
        manifest_bytes = found.get((ObjectKind.MANIFEST, digest), 0)
    own_bytes = manifest_bytes + sum(sizes[d] or 0 for d in own)
    return Usage(
        logical_bytes=manifest.logical_bytes(),
        stored_bytes=own_bytes,
        stored_with_bases=own_bytes + sum(sizes[d] or 0 for d in bases),
        chunks=len(own),
        base_chunks=len(bases),
        missing_chunks=sum(1 for size in sizes.values() if size is None),
        manifest_bytes=manifest_bytes,
    )
