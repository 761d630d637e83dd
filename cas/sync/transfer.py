"""Push/pull between stores: copy only the chunks and manifests the other side lacks, then CAS refs.

``transfer(src, dst, selectors)`` (``push`` and ``pull`` name the direction) works in the order a
save does, so a destination ref never names a manifest whose chunks are missing (invariant 1):

1. Read the selected refs on both sides (prefixes, exact names, globs like ``runs/r1/**``). The
   destination targets read here are the ``expected`` values of the final compare-and-swap.
2. Read and verify each selected manifest on the source and collect its chunk digests
   (``Manifest.chunk_digests()``, delta bases included).
3. Ask the destination which chunks and manifests it already has, in batches: ``has_many`` for
   small sets, a listing of the touched ``chunks/<xx>/`` prefixes when that costs fewer requests.
4. Copy the missing chunks in parallel as stored envelopes (the codec is kept); each blob is
   decoded and hashed on the way, so corrupt bytes never travel. With ``codec=`` set, chunks are
   re-encoded for the destination instead (``cas.objects.recode``), e.g. zstd for an archive. Copies are
   create-only: a chunk a destination writer stores meanwhile keeps that writer's encoding.
5. ``sync`` the destination, copy the manifests, ``sync`` again, then move each destination ref by
   compare-and-swap. A ref that moved meanwhile is a ``RefConflict``; everything copied stays, and
   the old target remains in the ref's history, so nothing is lost.

An interrupted transfer leaves only unreferenced chunks behind; run again, it finds them present
and copies the rest. Skipped chunks that the destination's current manifests do not name are
``touch``-ed so an age-based GC running there does not sweep them before the ref lands.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

from cas.blobstore.base import BlobStore
from cas.blobstore.bulk import has_many, touch_many
from cas.codecs import codec_by_id, codec_by_name
from cas.digest import Digest, digest_of
from cas.errors import BackendError, CASError, FormatError, IntegrityError, NotFound, RefConflict
from cas.model.manifest import ITEMSIZE, Manifest, decode_manifest
from cas.names import RefName
from cas.objects.store import ObjectStore, chunk_key, manifest_key, parse_envelope
from cas.refs.leases import LeaseManager
from cas.refs.store import RefStore

TransferProgress = Callable[[int, int], None]
"""Called with ``(bytes_moved, bytes_skipped)`` increments, in logical (decoded) bytes."""

LIST_MIN_KEYS = 2048
"""Below this many candidate chunks, asking per key (``has_many``) is always cheap enough."""
LIST_PAGE = 1000
"""Keys per listing request on S3 (ListObjectsV2's maximum page)."""
KEEP = "keep"
"""Copy stored objects as they are (the default codec choice)."""


class StoreSide(Protocol):
    """What a transfer needs from each side; ``cas.Repository`` provides it."""

    @property
    def blobs(self) -> BlobStore: ...

    @property
    def objects(self) -> ObjectStore: ...

    @property
    def refs_store(self) -> RefStore: ...

    @property
    def leases(self) -> LeaseManager: ...


@dataclass(frozen=True)
class RefUpdate:
    """What happened to one destination ref."""

    name: RefName
    old: Digest | None
    new: Digest
    status: str
    """``created``, ``updated``, ``unchanged`` (already there) or ``conflict`` (moved meanwhile)."""


@dataclass
class TransferReport:
    """What a transfer moved and skipped. Byte counts are logical (decoded) chunk bytes."""

    source: str
    destination: str
    refs: list[RefUpdate] = field(default_factory=list)
    chunks_moved: int = 0
    chunks_skipped: int = 0
    bytes_moved: int = 0
    bytes_skipped: int = 0
    manifests_moved: int = 0
    manifests_skipped: int = 0
    chunks_rewritten: int = 0
    """Chunks the destination held encoded against a base the copied manifests do not record,
    rewritten standalone so GC (which reads manifests only) can never sweep what they need."""
    wire_bytes: int = 0
    """Stored (encoded) bytes written to the destination, manifests included."""
    lookup: str = "has"
    """How missing chunks were found: ``has`` (one request per key) or ``list`` (by prefix)."""
    seconds: float = 0.0

    @property
    def refs_updated(self) -> int:
        """Refs created or moved."""
        return sum(1 for r in self.refs if r.status in ("created", "updated"))

    def as_dict(self) -> dict[str, object]:
        """Plain values for ``--json``."""
        return {
            "source": self.source,
            "destination": self.destination,
            "refs": [
                {"ref": r.name, "old": r.old, "new": r.new, "status": r.status} for r in self.refs
            ],
            "refs_updated": self.refs_updated,
            "chunks_moved": self.chunks_moved,
            "chunks_skipped": self.chunks_skipped,
            "bytes_moved": self.bytes_moved,
            "bytes_skipped": self.bytes_skipped,
            "manifests_moved": self.manifests_moved,
            "manifests_skipped": self.manifests_skipped,
            "chunks_rewritten": self.chunks_rewritten,
            "wire_bytes": self.wire_bytes,
            "lookup": self.lookup,
            "seconds": round(self.seconds, 3),
        }


class TransferConflict(RefConflict):
    """Some destination refs moved during the transfer; ``report`` says which, data is all there."""

    def __init__(self, message: str, report: TransferReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class _Selected:
    name: RefName
    target: Digest
    remote_old: Digest | None


def push(
    src: StoreSide,
    dst: StoreSide,
    selectors: Sequence[str],
    *,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    codec: str = KEEP,
) -> TransferReport:
    """Copy the refs ``selectors`` pick from ``src`` to ``dst`` (see the module docstring)."""
    return transfer(src, dst, selectors, jobs=jobs, progress=progress, codec=codec, op="push")


def pull(
    dst: StoreSide,
    src: StoreSide,
    selectors: Sequence[str],
    *,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    codec: str = KEEP,
) -> TransferReport:
    """Copy the refs ``selectors`` pick from the remote ``src`` into the local ``dst``."""
    return transfer(src, dst, selectors, jobs=jobs, progress=progress, codec=codec, op="pull")


def transfer(
    src: StoreSide,
    dst: StoreSide,
    selectors: Sequence[str],
    *,
    jobs: int = 16,
    progress: TransferProgress | None = None,
    codec: str = KEEP,
    op: str = "transfer",
    clock: Callable[[], float] = time.monotonic,
) -> TransferReport:
    """Make ``dst`` hold what the selected refs of ``src`` name, and point its refs there.

    ``codec="keep"`` copies stored objects as they are; a codec name (``zstd``, ``raw``,
    ``auto``...) re-encodes each copied chunk for the destination (``cas.objects.recode``), e.g. to
    archive compressed. The whole transfer holds a writer lease on ``dst`` (``cas.refs.leases``), so
    a GC running there spares what it copies, and the refs move only while the lease is live.
    """
    with dst.leases.hold(op):
        return _transfer(src, dst, selectors, jobs, progress, codec, op, clock)


def _transfer(
    src: StoreSide,
    dst: StoreSide,
    selectors: Sequence[str],
    jobs: int,
    progress: TransferProgress | None,
    codec: str,
    op: str,
    clock: Callable[[], float],
) -> TransferReport:
    began = clock()
    report = TransferReport(src.blobs.url, dst.blobs.url)
    report_progress = progress or (lambda moved, skipped: None)
    selected = select_refs(src.refs_store, dst.refs_store, selectors)

    manifests: dict[Digest, tuple[bytes, Manifest]] = {}
    for item in selected:
        if item.target not in manifests:
            manifests[item.target] = read_manifest_blob(src.objects, item.target)
    wanted: dict[Digest, int] = {}
    for _, manifest in manifests.values():
        for ref in manifest.chunk_refs():
            wanted[ref.digest] = ref.size
        for digest in manifest.chunk_digests():
            wanted.setdefault(digest, 0)  # a delta base of unknown size; counted when copied

    missing_chunks, report.lookup = find_missing(dst.blobs, [chunk_key(d) for d in wanted])
    missing = [d for d in wanted if chunk_key(d) in missing_chunks]
    skipped = [d for d in wanted if chunk_key(d) not in missing_chunks]
    report.chunks_skipped = len(skipped)
    report.bytes_skipped = sum(wanted[d] for d in skipped)
    report_progress(0, report.bytes_skipped)
    _freshen(dst, skipped, jobs)

    copier = _ChunkCopier(src, dst, report, report_progress, codec, _element_sizes(manifests))
    copier.copy_all(missing, jobs)
    _reconcile_chains(src, dst, [*skipped, *copier.lost], manifests, report, jobs)
    dst.blobs.sync()

    present = has_many(dst.blobs, [manifest_key(d) for d in manifests])
    for digest, (blob, _) in manifests.items():
        if present[manifest_key(digest)]:
            # It may be an unreferenced leftover: refresh it so GC's age check spares it.
            with contextlib.suppress(NotFound):
                dst.blobs.touch(manifest_key(digest))
            report.manifests_skipped += 1
            continue
        dst.blobs.put(manifest_key(digest), blob)
        report.manifests_moved += 1
        report.wire_bytes += len(blob)
    dst.blobs.sync()

    dst.leases.check()
    for item in selected:
        report.refs.append(_move_ref(dst.refs_store, item, op, src.blobs.url))
    report.seconds = clock() - began
    conflicts = [r for r in report.refs if r.status == "conflict"]
    if conflicts:
        names = ", ".join(r.name for r in conflicts)
        raise TransferConflict(
            f"{len(conflicts)} ref(s) on {dst.blobs.url} moved during the {op}: {names}; every "
            "chunk and manifest was copied, so running it again to point them here anyway "
            "moves no data (their other targets stay in the ref history)",
            report,
        )
    return report


def select_refs(src: RefStore, dst: RefStore, selectors: Sequence[str]) -> list[_Selected]:
    """The source refs the selectors name, with their targets on both sides, read now."""
    if not selectors:
        raise NotFound("no refs selected: name refs, prefixes or globs like 'runs/r1/**'")
    names: set[RefName] = set()
    for selector in selectors:
        found = list(src.names(selector))
        if not found:
            raise NotFound(f"no ref matches {selector!r} in {src.blobs.url}")
        names.update(found)
    selected = []
    for name in sorted(names):
        record = src.try_get(name)
        if record is None:
            continue  # deleted since it was listed
        remote = dst.try_get(name)
        selected.append(_Selected(name, record.target, remote.target if remote else None))
    if not selected:
        raise NotFound(f"the refs selected by {list(selectors)} vanished from {src.blobs.url}")
    return selected


def read_manifest_blob(objects: ObjectStore, digest: Digest) -> tuple[bytes, Manifest]:
    """The stored manifest object (to copy as is) and its verified, decoded manifest."""
    try:
        blob = objects.blobs.get(manifest_key(digest))
    except NotFound as e:
        raise NotFound(f"manifest {digest} is missing from {objects.blobs.url}") from e
    decoded = verify_object(objects, digest, blob, what="manifest")
    return blob, decode_manifest(bytes(decoded))


def verify_object(
    objects: ObjectStore, digest: Digest, blob: bytes, *, what: str = "chunk"
) -> bytes | memoryview:
    """Decode a stored object and check it hashes to ``digest``; delta bases come from ``objects``."""
    try:
        envelope = parse_envelope(blob, objects.max_object_size)
        codec = codec_by_id(envelope.codec_id)
        decoded = codec.decode(
            envelope.params,
            memoryview(blob)[envelope.payload_offset :],
            envelope.decoded_size,
            objects.get_chunk,
        )
    except FormatError as e:
        raise IntegrityError(f"{what} {digest} in {objects.blobs.url} is corrupt: {e}") from e
    if len(decoded) != envelope.decoded_size or digest_of(decoded) != digest:
        raise IntegrityError(
            f"{what} {digest} in {objects.blobs.url} is corrupt: its bytes hash to something else"
        )
    return decoded


def find_missing(blobs: BlobStore, keys: Sequence[str]) -> tuple[set[str], str]:
    """The subset of ``keys`` (``chunks/xx/<digest>``) ``blobs`` lacks, and the method used.

    One existence request per key costs ``len(keys)`` requests; listing the touched prefixes
    costs about ``prefixes * ceil(keys_per_prefix / 1000)``. Above ``LIST_MIN_KEYS`` one prefix is
    listed to estimate the destination's density, and the cheaper method is used for the rest.
    """
    if len(keys) < LIST_MIN_KEYS:
        present = has_many(blobs, keys)
        return {k for k, there in present.items() if not there}, "has"
    by_prefix: dict[str, list[str]] = {}
    for key in keys:
        by_prefix.setdefault(key.rpartition("/")[0] + "/", []).append(key)
    prefixes = sorted(by_prefix)
    sample = set(blobs.list(prefixes[0]))
    per_prefix = max(1, math.ceil(len(sample) / LIST_PAGE))
    list_requests = len(prefixes) * per_prefix
    if list_requests * 2 >= len(keys):
        present = has_many(blobs, keys)
        return {k for k, there in present.items() if not there}, "has"
    listed = {prefixes[0]: sample}
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="cas-list") as pool:
        for prefix, found in zip(
            prefixes[1:], pool.map(_list_set(blobs), prefixes[1:]), strict=True
        ):
            listed[prefix] = found
    return {k for p, ks in by_prefix.items() for k in ks if k not in listed[p]}, "list"


def _list_set(blobs: BlobStore) -> Callable[[str], set[str]]:
    return lambda prefix: set(blobs.list(prefix))


def _freshen(dst: StoreSide, skipped: Iterable[Digest], jobs: int) -> None:
    """Touch every skipped chunk so GC's age check spares it while the refs move.

    A chunk a destination manifest keeps alive today is no exception: the ref naming that
    manifest may move meanwhile, and the refs this transfer moves would then name a swept chunk.
    A chunk swept before its touch is stored again by ``_reconcile_chains``.
    """
    touch_many(dst.blobs, [chunk_key(d) for d in skipped], jobs)


def _reconcile_chains(
    src: StoreSide,
    dst: StoreSide,
    found: Sequence[Digest],
    manifests: dict[Digest, tuple[bytes, Manifest]],
    report: TransferReport,
    jobs: int,
) -> None:
    """Rewrite standalone each chunk ``dst`` already held encoded against a base the copied
    manifests do not list for it.

    Manifests are copied byte for byte, so their ``encoding["base"]`` lists the source's chains.
    A chunk the destination stored itself (skipped here, or written by a racing writer first)
    may be a delta against a base only the destination's own manifests keep alive; once those
    are gone, GC would sweep that base from under the copied checkpoint. One header read per
    such chunk finds them; a standalone chunk needs no base.
    """
    allowed: dict[Digest, set[Digest]] = {}
    for _, manifest in manifests.values():
        for entry in manifest.tensors:
            bases = set(entry.base_digests())
            for digest in [*(ref.digest for ref in entry.chunks), *bases]:
                allowed.setdefault(digest, set()).update(bases)

    def check(digest: Digest) -> bool:
        try:
            base = dst.objects.chunk_base(digest)
            if base is None or base in allowed.get(digest, set()):
                return False
        except (NotFound, IntegrityError):
            pass  # swept or damaged since it was found: store a good copy
        data = src.objects.get_chunk(digest)  # verified
        dst.objects.put_chunk(data, codec_by_name("zstd"), digest=digest, replace=True)
        return True

    if not found:
        return
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="cas-chains") as pool:
        report.chunks_rewritten += sum(pool.map(check, sorted(set(found))))


class _ChunkCopier:
    """Copies chunk envelopes source -> destination on a thread pool, verifying each one."""

    def __init__(
        self,
        src: StoreSide,
        dst: StoreSide,
        report: TransferReport,
        progress: TransferProgress,
        codec: str,
        elem_sizes: dict[Digest, int],
    ) -> None:
        self.src = src
        self.dst = dst
        self.report = report
        self.progress = progress
        self.codec = codec
        self.elem_sizes = elem_sizes
        self._lock = threading.Lock()
        self._bases: set[Digest] = set()
        self.lost: list[Digest] = []
        """Chunks another writer stored at the destination first (its encoding stayed)."""
        self._beat = dst.leases.beat(None)

    def copy_all(self, digests: Sequence[Digest], jobs: int) -> None:
        """Copy every digest; the first failure stops the rest and is raised as BackendError."""
        todo = list(digests)
        done: set[Digest] = set()
        while todo:
            self._run(todo, jobs)
            done.update(todo)
            # Bases a manifest did not list (deltas of deltas) must travel too.
            extra = sorted(self._bases - done)
            if not extra:
                break
            present = has_many(self.dst.blobs, [chunk_key(d) for d in extra])
            done.update(d for d in extra if present[chunk_key(d)])
            todo = [d for d in extra if not present[chunk_key(d)]]

    def _run(self, digests: Sequence[Digest], jobs: int) -> None:
        pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="cas-copy")
        futures: list[Future[None]] = []
        try:
            futures = [pool.submit(self._copy_one, d) for d in digests]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in finished if f.exception() is not None), None)
            if failed is not None:
                pool.shutdown(wait=True, cancel_futures=True)
                self._fail(failed.exception(), len(digests))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)

    def _fail(self, error: BaseException | None, total: int) -> None:
        assert error is not None
        if not isinstance(error, Exception):
            raise error
        where = f"{self.src.blobs.url} -> {self.dst.blobs.url}"
        summary = (
            f"copy {where} stopped after {self.report.chunks_moved} of {total} missing chunks "
            f"({self.report.bytes_moved} bytes); no destination ref was changed, run it again to "
            f"copy the rest: {type(error).__name__}: {error}"
        )
        if isinstance(error, (IntegrityError, NotFound)):
            raise type(error)(summary) from error
        if isinstance(error, CASError) and not isinstance(error, BackendError):
            raise error
        raise BackendError(summary) from error

    def _copy_one(self, digest: Digest) -> None:
        if self.codec != KEEP:
            self._recode_one(digest)
            return
        key = chunk_key(digest)
        try:
            blob = self.src.blobs.get(key)
        except NotFound as e:
            raise NotFound(f"chunk {digest} is missing from {self.src.blobs.url}") from e
        decoded = verify_object(self.src.objects, digest, blob)
        envelope = parse_envelope(blob, self.src.objects.max_object_size)
        base = codec_by_id(envelope.codec_id).base_of(envelope.params)
        # Create-only: a chunk a writer stored at the destination meanwhile, perhaps as a delta
        # against another base that its manifest records, must not be replaced.
        created = self.dst.blobs.put_if_absent(key, blob)
        with self._lock:
            if base is not None:
                self._bases.add(base)
        self._counted(digest, created, len(decoded), len(blob))

    def _recode_one(self, digest: Digest) -> None:
        from cas.objects.recode import recode_chunk

        try:
            result = recode_chunk(
                self.src.objects,
                self.dst.objects,
                digest,
                self.codec,
                elem_size=self.elem_sizes.get(digest, 1),
            )
        except NotFound as e:
            raise NotFound(f"chunk {digest} is missing from {self.src.blobs.url}") from e
        self._counted(digest, result.new, result.size, result.stored_bytes)

    def _counted(self, digest: Digest, created: bool, size: int, stored: int) -> None:
        """Report one copied chunk: moved, or skipped if another writer stored it first."""
        with self._lock:
            if created:
                self.report.chunks_moved += 1
                self.report.bytes_moved += size
                self.report.wire_bytes += stored
            else:
                self.lost.append(digest)
                self.report.chunks_skipped += 1
                self.report.bytes_skipped += size
        if created:
            self.progress(size, 0)
        else:
            self.progress(0, size)
        if self._beat is not None:
            self._beat(size)


def _element_sizes(manifests: dict[Digest, tuple[bytes, Manifest]]) -> dict[Digest, int]:
    """Each tensor chunk's element size, for byte-grouping codecs when re-encoding."""
    sizes: dict[Digest, int] = {}
    for _, manifest in manifests.values():
        for tensor in manifest.tensors:
            for ref in tensor.chunks:
                sizes.setdefault(ref.digest, ITEMSIZE.get(tensor.dtype, 1))
    return sizes


def _move_ref(dst: RefStore, item: _Selected, op: str, source_url: str) -> RefUpdate:
    if item.remote_old == item.target:
        return RefUpdate(item.name, item.remote_old, item.target, "unchanged")
    try:
        dst.set(
            item.name, item.target, expected=item.remote_old, op=op, message=f"from {source_url}"
        )
    except RefConflict:
        return RefUpdate(item.name, item.remote_old, item.target, "conflict")
    status = "created" if item.remote_old is None else "updated"
    return RefUpdate(item.name, item.remote_old, item.target, status)
