"""What a store holds: listing, stat, existence and refresh of many objects at once.

Functions of a ``BlobStore`` that ``ObjectStore`` offers as named methods, so that retention and
transfers ask about objects by kind and digest and never see a key. Requests over many objects
run ``workers`` at a time, to hide a remote store's round trips.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from cas.blobstore.base import BlobStore
from cas.blobstore.bulk import DEFAULT_WORKERS, has_many, touch_many
from cas.blobstore.local import disk_errors
from cas.digest import Digest
from cas.errors import NotFound
from cas.objects.keys import ObjectKind, StoredObject, object_key

LIST_MIN_KEYS = 2048
"""Below this many objects, asking per key (``has_many``) is always cheap enough."""
LIST_PAGE = 1000
"""Keys per listing request on S3 (ListObjectsV2's maximum page)."""
STAT_LIMIT = 2000
"""Up to this many objects are sized with one ``stat`` each; beyond it one listing is cheaper."""
_SHARD_RE = re.compile(r"[0-9a-f]{2}")


def list_objects(blobs: BlobStore, kind: ObjectKind) -> Iterator[StoredObject]:
    """Every object of ``kind`` with its stored size and mtime; keys of any other shape are no
    objects and are skipped."""
    root = blobs.local_root
    if root is not None:
        yield from _scan_local(os.path.join(root, kind.value), kind)
        return
    for info in blobs.list_info(kind.prefix):
        match = kind.pattern.fullmatch(info.key)
        if match is not None:
            yield StoredObject(kind, Digest(match.group(2)), info.size, info.mtime)


def _scan_local(top: str, kind: ObjectKind) -> Iterator[StoredObject]:
    """The shard directories directly: a million objects in a few seconds."""
    with disk_errors("listing", top):
        yield from _scan_shards(top, kind)


def _scan_shards(top: str, kind: ObjectKind) -> Iterator[StoredObject]:
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
                if kind.pattern.fullmatch(f"{kind.prefix}{shard.name}/{name}"):
                    yield StoredObject(kind, Digest(name), st.st_size, st.st_mtime)


def stat_object(blobs: BlobStore, kind: ObjectKind, digest: Digest) -> StoredObject:
    """Stored size and mtime of one object; NotFound if it is not stored."""
    try:
        info = blobs.stat(object_key(kind, digest))
    except NotFound as e:
        raise NotFound(f"{kind.noun} {digest} is missing from the store") from e
    return StoredObject(kind, digest, info.size, info.mtime)


def stored_sizes(
    blobs: BlobStore,
    objects: Iterable[tuple[ObjectKind, Digest]],
    workers: int = DEFAULT_WORKERS,
) -> dict[tuple[ObjectKind, Digest], int]:
    """Stored bytes of each object; a missing one is left out. A few are statted one by one,
    many are found in one listing per kind."""
    wanted = set(objects)
    if len(wanted) <= STAT_LIMIT:

        def size_of(obj: tuple[ObjectKind, Digest]) -> int | None:
            try:
                return blobs.stat(object_key(*obj)).size
            except NotFound:
                return None

        found = zip(wanted, _map(size_of, list(wanted), workers), strict=True)
        return {obj: size for obj, size in found if size is not None}
    sizes: dict[tuple[ObjectKind, Digest], int] = {}
    for kind in ObjectKind:
        if any(k is kind for k, _ in wanted):
            for stored in list_objects(blobs, kind):
                if (kind, stored.digest) in wanted:
                    sizes[(kind, stored.digest)] = stored.size
    return sizes


def present(
    blobs: BlobStore, kind: ObjectKind, digests: Iterable[Digest], workers: int = DEFAULT_WORKERS
) -> dict[Digest, bool]:
    """Whether each object is stored, asked ``workers`` at a time."""
    wanted = list(digests)
    found = has_many(blobs, [object_key(kind, d) for d in wanted], workers)
    return {d: found[object_key(kind, d)] for d in wanted}


def missing(
    blobs: BlobStore, kind: ObjectKind, digests: Sequence[Digest]
) -> tuple[set[Digest], str]:
    """The subset of ``digests`` the store lacks, and the method used (``has`` or ``list``).

    One existence request per object costs ``len(digests)`` requests; listing the touched shard
    prefixes costs about ``prefixes * ceil(objects_per_prefix / 1000)``. Above ``LIST_MIN_KEYS``
    one prefix is listed to estimate the store's density, and the cheaper method is used.
    """
    if len(digests) < LIST_MIN_KEYS:
        return {d for d, there in present(blobs, kind, digests).items() if not there}, "has"
    by_prefix: dict[str, list[Digest]] = {}
    for digest in digests:
        by_prefix.setdefault(object_key(kind, digest).rpartition("/")[0] + "/", []).append(digest)
    prefixes = sorted(by_prefix)
    sample = set(blobs.list(prefixes[0]))
    per_prefix = max(1, math.ceil(len(sample) / LIST_PAGE))
    if len(prefixes) * per_prefix * 2 >= len(digests):
        return {d for d, there in present(blobs, kind, digests).items() if not there}, "has"
    listed = {prefixes[0]: sample}
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="cas-list") as pool:
        for prefix, keys in zip(
            prefixes[1:], pool.map(lambda p: set(blobs.list(p)), prefixes[1:]), strict=True
        ):
            listed[prefix] = keys
    return {
        d for p, ds in by_prefix.items() for d in ds if object_key(kind, d) not in listed[p]
    }, "list"


def freshen(
    blobs: BlobStore, kind: ObjectKind, digests: Iterable[Digest], workers: int = DEFAULT_WORKERS
) -> list[Digest]:
    """Set each object's mtime to now, so an age-based GC spares it; return those not stored."""
    wanted = list(digests)
    gone = set(touch_many(blobs, [object_key(kind, d) for d in wanted], workers))
    return [d for d in wanted if object_key(kind, d) in gone]


def _map(
    fn: Callable[[tuple[ObjectKind, Digest]], int | None],
    items: list[tuple[ObjectKind, Digest]],
    workers: int,
) -> list[int | None]:
    if len(items) < 4:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cas-stat") as pool:
        return list(pool.map(fn, items))
