"""Space accounting: logical, stored, exclusive and shared bytes of refs, and store-wide statistics.

Everything is computed from refs and manifests (which chunks each names, and their decoded sizes)
plus the stored size of each object (one listing, or one ``stat`` per object for small sets). An
object is a chunk, keyed by its digest, or a manifest blob, keyed ``m/<digest>``. ``exclusive``
bytes of a ref are those of objects no other ref names: what removing the ref (then ``cas gc``)
frees. Ref history is not counted here; ``cas gc`` keeps recent history alive for a while.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cas.digest import Digest
from cas.errors import CASError, NotFound
from cas.model.manifest import Manifest, decode_manifest
from cas.names import ref_matches
from cas.objects.store import chunk_key, manifest_key
from cas.refs.store import RefRecord

if TYPE_CHECKING:
    from cas.repo.repository import Repository

STAT_LIMIT = 2000
"""Up to this many objects are sized with one ``stat`` each; beyond it one listing is cheaper."""
CHUNK_KEY_RE = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})")
MANIFEST_KEY_RE = re.compile(r"manifests/([0-9a-f]{2})/(\1[0-9a-f]{62})")


def manifest_object(digest: Digest) -> str:
    """The object id of a manifest blob (chunks use their bare digest)."""
    return "m/" + digest


def object_key(obj: str) -> str:
    """The blob key of an object id."""
    return manifest_key(Digest(obj[2:])) if obj.startswith("m/") else chunk_key(Digest(obj))


@dataclass(frozen=True)
class RefContent:
    """What one ref names, read from its manifest: metadata and the set of objects it keeps."""

    record: RefRecord
    kind: str
    created_at: float
    meta: dict[str, Any]
    logical_bytes: int
    objects: frozenset[str]
    chunk_sizes: dict[str, int]
    """Decoded size of each chunk the ref names."""

    @property
    def name(self) -> str:
        """The ref's name."""
        return self.record.name

    @property
    def target(self) -> Digest:
        """The manifest digest the ref names."""
        return self.record.target


def read_manifest(repo: Repository, digest: Digest, context: str) -> Manifest:
    """Decode a manifest, turning failures into errors that say which ref needed it."""
    try:
        return decode_manifest(repo.objects.get_manifest(digest))
    except CASError as e:
        raise type(e)(f"{context}: manifest {digest[:16]}: {e}") from e


def read_contents(repo: Repository, records: Sequence[RefRecord]) -> list[RefContent]:
    """The content of each ref (each distinct manifest is read once, in parallel)."""
    targets = sorted({r.target for r in records})
    owner = {r.target: r.name for r in reversed(records)}
    manifests = dict(
        zip(
            targets,
            repo.io.pool.map(lambda d: read_manifest(repo, d, f"ref {owner[d]!r}"), targets),
            strict=True,
        )
    )
    summaries: dict[Digest, tuple[frozenset[str], dict[str, int]]] = {}
    out = []
    for record in records:
        manifest = manifests[record.target]
        if record.target not in summaries:
            decoded: dict[str, int] = {ref.digest: ref.size for ref in manifest.chunk_refs()}
            named: set[str] = {manifest_object(record.target), *manifest.chunk_digests()}
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


def object_sizes(repo: Repository, objects: Iterable[str]) -> dict[str, int]:
    """Stored bytes of each object; a missing object is left out."""
    wanted = set(objects)
    if len(wanted) <= STAT_LIMIT:

        def size_of(obj: str) -> int | None:
            try:
                return repo.blobs.stat(object_key(obj)).size
            except NotFound:
                return None

        found = zip(wanted, repo.io.pool.map(size_of, wanted), strict=True)
        return {obj: size for obj, size in found if size is not None}
    sizes: dict[str, int] = {}
    for prefix, pattern, tag in (
        ("chunks/", CHUNK_KEY_RE, ""),
        ("manifests/", MANIFEST_KEY_RE, "m/"),
    ):
        for info in repo.blobs.list_info(prefix):
            match = pattern.fullmatch(info.key)
            if match is not None and tag + match.group(2) in wanted:
                sizes[tag + match.group(2)] = info.size
    return sizes


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
        }


def disk_usage(repo: Repository, selector: str = "") -> UsageReport:
    """Logical, stored, exclusive (freed if the selection were removed) and shared bytes."""
    contents = read_contents(repo, repo.refs())
    counts: Counter[str] = Counter()
    for content in contents:
        counts.update(content.objects)
    selected = [c for c in contents if ref_matches(c.name, selector)]
    union: set[str] = set()
    selected_counts: Counter[str] = Counter()
    for content in selected:
        union |= content.objects
        selected_counts.update(content.objects)
    sizes = object_sizes(repo, union)
    rows = tuple(
        RefUsage(
            c.name,
            c.target,
            c.logical_bytes,
            sum(sizes.get(o, 0) for o in c.objects),
            sum(sizes.get(o, 0) for o in c.objects if counts[o] == 1),
        )
        for c in selected
    )
    return UsageReport(
        selector,
        rows,
        sum(c.logical_bytes for c in selected),
        sum(sizes.get(o, 0) for o in union),
        sum(sizes.get(o, 0) for o in union if selected_counts[o] == counts[o]),
        len(union - sizes.keys()),
    )


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
    unique_bytes: int
    """Decoded bytes of the distinct chunks refs reach."""
    logical_bytes: int
    """What every ref would take as an independent copy."""

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes per distinct decoded byte (copies and unchanged tensors cost nothing)."""
        return self.logical_bytes / self.unique_bytes if self.unique_bytes else 1.0

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
            "dedup_ratio": round(self.dedup_ratio, 4),
            "compression_ratio": round(self.compression_ratio, 4),
            "unreachable_bytes": self.unreachable_bytes,
        }


def store_stats(repo: Repository) -> StoreStats:
    """Count chunks and manifests, and the dedup and compression ratios of what refs reach."""
    contents = read_contents(repo, repo.refs())
    decoded: dict[str, int] = {}
    named: set[str] = set()
    for content in contents:
        decoded.update(content.chunk_sizes)
        named |= content.objects
    chunks = chunk_bytes = reachable = reachable_bytes = 0
    for info in repo.blobs.list_info("chunks/"):
        match = CHUNK_KEY_RE.fullmatch(info.key)
        if match is None:
            continue
        chunks += 1
        chunk_bytes += info.size
        if match.group(2) in named:
            reachable += 1
            reachable_bytes += info.size
    manifests = manifest_bytes = 0
    for info in repo.blobs.list_info("manifests/"):
        if MANIFEST_KEY_RE.fullmatch(info.key):
            manifests += 1
            manifest_bytes += info.size
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
    )
